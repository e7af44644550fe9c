"""Every field of vLLM's request models and what ``tidegate serve`` does with it: served, accepted and ignored
(why), or refused with 400 (what is not served). Reads the models from vLLM's own venv.

    python benchmarks/vllm_fields.py [--vllm-python .venv-vllm/bin/python] [--out bench-out/vllm_fields.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tidegate.engine.serve.vllm_fields import field_rows, tally, vllm_request_fields

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (Markdown)")
    args = parser.parse_args()
    rows = field_rows(vllm_request_fields(args.vllm_python))
    lines = ["| route | field | tidegate |", "|---|---|---|"]
    lines += [f"| {r.route} | `{r.field}` | {r.handling or 'UNCLASSIFIED'} |" for r in rows]
    counts = tally(rows)
    lines += ["", f"{len(rows)} rows: " + ", ".join(f"{n} {kind}" for kind, n in counts.items())]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
