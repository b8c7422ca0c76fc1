"""docs/cli.md's engine-flag table says it is ``python -m asyncllm.cli_args``'s output: it must be, row for row, so
that a field's changed help or default (asyncllm/config*.py) shows in the docs (the kv_cache_dtype row drifted on
2026-12-08)."""

from __future__ import annotations

from pathlib import Path

from asyncllm.cli_args import markdown_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_the_engine_flag_table_of_cli_md_is_cli_args_output() -> None:
    lines = DOC.read_text().splitlines()
    start = lines.index("| flag | value | default | what |")
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    documented, generated = lines[start:end], markdown_table().splitlines()
    drifted = [(doc, gen) for doc, gen in zip(documented, generated) if doc != gen]
    assert not drifted and len(documented) == len(generated), (drifted[:3], len(documented), len(generated))
