"""Write an S-LoRA-style workload as JSONL (see runtime/bench/workload.py for the parameters).

    python benchmarks/workload.py --adapters 16 --popularity zipf --alpha 1 --rate 4 --out w.jsonl
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's runtime, as the other scripts here

from runtime.bench.workload import main  # noqa: E402

if __name__ == "__main__":
    main()
