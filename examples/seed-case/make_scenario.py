"""Write the seed case's two launches into a folder: python make_scenario.py DIR."""

from __future__ import annotations

import sys
from pathlib import Path

from nanwatch.demo.simulate import seed_scenario


def main() -> None:
    base = Path(sys.argv[1] if len(sys.argv) > 1 else "seed-case-output")
    for run in seed_scenario(base):
        run.write()
        print(run.launch_dir)


if __name__ == "__main__":
    main()
