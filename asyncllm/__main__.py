"""The ``asyncllm`` command (pyproject's console entry point) and ``python -m asyncllm``: asyncllm/cli.py, imported
here, so that a Ctrl-C while the command still imports (its flags' modules, the engine's config: half a second)
ends it as a Ctrl-C later does, exit 130 with no traceback. ``import asyncllm`` itself imports nothing more."""

import sys


def main() -> None:
    try:
        from asyncllm.cli import main as run

        run()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
