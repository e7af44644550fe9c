"""The layout's promises: public API, the import rule, no torch below engine/real, one CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_import_contracts_hold():
    """ctrl <- engine <- env <- training, engine's subpackages one way, no cycles (pyproject.toml)."""
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (it comes with the dev extras)")
    proc = subprocess.run([str(lint)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_public_api_loads_torch_only_when_asked():
    proc = run_python(
        "import sys\n"
        "from engine import EngineCore, Request, simulate, load_profile\n"
        "from ctrl import build_controller\n"
        "assert 'torch' not in sys.modules, 'the torch-free API imported torch'\n"
        "from engine import LLM, SamplingParams\n"
        "assert 'torch' in sys.modules\n"
        "print(EngineCore.__module__, LLM.__module__)\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["tidegate.engine.core.engine_core", "tidegate.engine.real.llm"]


def test_every_subcommand_loads_and_has_help():
    from click.testing import CliRunner

    from tidegate.engine.cli import COMMANDS, main

    runner = CliRunner()
    listing = runner.invoke(main, ["--help"])
    assert listing.exit_code == 0, listing.output
    for name in COMMANDS:
        assert name in listing.output
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0, f"{name}: {result.output}"


def test_no_argparse_mains_shadow_the_cli():
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.glob("*/**/*.py")
                 if p.parts[len(ROOT.parts)] in ("ctrl", "engine", "env", "training")
                 and "argparse" in p.read_text()]
    assert offenders == []


def test_every_import_names_the_one_package():
    """The subpackages install under `tidegate` only: nothing imports them by their folder names."""
    import re
    bare = re.compile(r"^\s*(from|import) (engine|ctrl|env|training|checkpoints)\b", re.M)
    offenders = [str(p.relative_to(ROOT)) for folder in ("ctrl", "engine", "env", "training", "checkpoints",
                                                          "tests", "benchmarks", "tidegate")
                 for p in (ROOT / folder).rglob("*.py") if bare.search(p.read_text())]
    assert offenders == []


def test_the_docs_links_resolve():
    """Every relative link in the README and docs/ points at a file or folder of the repository."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            target = match.group(1)
            if "://" not in target and not target.startswith("mailto:") and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
