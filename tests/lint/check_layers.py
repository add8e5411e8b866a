#!/usr/bin/env python3
"""Checks that the engine's layers depend on each other one way only.

Each folder under src/ may include headers from the layers listed for it below (and from
itself and the public headers under include/loom); anything else is a dependency running
the wrong way, and this script names the file, the line and the rule it breaks.
Usage: check_layers.py <repository root>
"""

import pathlib
import re
import sys

# Layer -> the layers it may include, lowest first. docs/ARCHITECTURE.md draws the same.
ALLOWED = {
    "common": set(),
    "util": {"common"},
    "kernels": {"common", "util"},
    "store": {"common", "util"},
    "transport": {"common", "util"},
    "cuda": {"common", "util"},
    "algorithms": {"common", "util", "kernels", "transport"},
    "core": {"common", "util", "kernels", "store", "transport", "algorithms", "cuda"},
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/')


def layer_of(path: pathlib.Path, src: pathlib.Path) -> str:
    return path.relative_to(src).parts[0]


def main() -> int:
    root = pathlib.Path(sys.argv[1]).resolve()
    src = root / "src"
    problems = []
    for path in sorted(src.rglob("*")):
        if path.suffix not in (".h", ".cc"):
            continue
        layer = layer_of(path, src)
        if layer not in ALLOWED:
            problems.append(f"{path.relative_to(root)}: src/{layer} is not a known layer; "
                            f"add it to {pathlib.Path(__file__).name} and docs/ARCHITECTURE.md")
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            match = INCLUDE.match(line)
            if not match:
                continue
            target = match.group(1)
            if target in ("loom", layer) or target in ALLOWED[layer]:
                continue
            problems.append(
                f"{path.relative_to(root)}:{number}: src/{layer} includes {target}/ but may "
                f"include only {', '.join(sorted(ALLOWED[layer] | {layer, 'loom'}))}")
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} include(s) run against the layering")
        return 1
    print("layers: every include runs one way")
    return 0


if __name__ == "__main__":
    sys.exit(main())
