"""`lorafleet merge`: bake one LoRA adapter into the base weights, verify, and record where it came from.

merger.py    W' = W + scale * B @ A (float32, then cast); int8 bases: dequantize -> merge -> requantize
staging.py   the output folder: checks, staging folder, atomic publish
verify.py    teacher-forced logit comparison against the dynamic path
report.py    the printed table
manifest.py  the JSON record next to the weights
merge_job.py one run of the command, in that order
"""
