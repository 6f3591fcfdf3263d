"""Write an S-LoRA-style workload as JSONL (see runtime/bench/workload.py for the parameters).

    python benchmarks/workload.py --adapters 16 --popularity zipf --alpha 1 --rate 4 --out w.jsonl
"""
from runtime.bench.workload import main

if __name__ == "__main__":
    main()
