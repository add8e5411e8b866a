#!/usr/bin/env python3
"""Checks that nothing built into the torch extension formats text through C++ streams.

The extension's copy of the standard library's stream code has crashed on the GPU hosts
(torch 2.11, their GCC 13) the first time it wrote a number into a stream: inside
std::ostream's number output, as c10::str does for TORCH_CHECK and TORCH_WARN with more than
one message argument (seen in tensor_args.cc's invalid(), then in Work.get_duration()'s
refusals: docs/perf/cuda_timing_h100.txt). The CPU builds never crash, so this lint is what
keeps the rule: messages are one ready std::string (std::to_string for numbers), and the
engine's sources (linked into the extension) use no C++ streams (string, file or console):
C stdio for files.
Usage: check_messages.py <repository root>
"""

import pathlib
import re
import sys

# Macro -> how many arguments it may take: the condition, if any, and one ready message.
MESSAGE_MACROS = {
    "TORCH_CHECK": 2, "TORCH_CHECK_VALUE": 2, "TORCH_CHECK_TYPE": 2, "TORCH_CHECK_INDEX": 2,
    "TORCH_CHECK_NOT_IMPLEMENTED": 2, "TORCH_INTERNAL_ASSERT": 2, "TORCH_WARN": 1,
    "TORCH_WARN_ONCE": 1, "c10::str": 1,
}
CALL = re.compile(r"\b(" + "|".join(re.escape(m) for m in MESSAGE_MACROS) + r")\s*\(")
STREAMS = re.compile(r"#\s*include\s*<(sstream|fstream|iostream|iomanip|ostream|istream)>|"
                     r"\bstd::(o|i)?(string|f)stream\b|\bstd::(cout|cerr|clog)\b")


def arguments(text: str, start: int) -> list[str]:
    """The top-level arguments of the call whose '(' is at `start`."""
    depth, args, current, i = 0, [], [], start
    while i < len(text):
        c = text[i]
        if c in "\"'":  # a literal: copied whole, escapes included
            j = i + 1
            while j < len(text) and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            current.append(text[i:j + 1])
            i = j + 1
            continue
        if c in "([{":
            depth += 1
            if depth == 1:
                i += 1
                continue
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                args.append("".join(current).strip())
                return [a for a in args if a]
        elif c == "," and depth == 1:
            args.append("".join(current).strip())
            current = []
            i += 1
            continue
        current.append(c)
        i += 1
    return args


def without_comments(text: str) -> str:
    """`text` with // and /* */ comments blanked, line numbers kept."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text,
                  flags=re.S)


def problems(root: pathlib.Path) -> list[str]:
    found = []
    for folder in ("torch_plugin", "src", "include"):
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in (".h", ".cc", ".cu", ".cuh"):
                continue
            text = without_comments(path.read_text())
            def where(pos: int, path=path, text=text) -> str:
                return f"{path.relative_to(root)}:{text.count(chr(10), 0, pos) + 1}"
            for m in STREAMS.finditer(text):
                found.append(f"{where(m.start())}: {m.group(0).strip()}: no C++ streams in code "
                             "built into the extension; build text with std::string, write "
                             "files with C stdio")
            if folder != "torch_plugin":
                continue
            for m in CALL.finditer(text):
                args = arguments(text, m.end() - 1)
                if len(args) > MESSAGE_MACROS[m.group(1)]:
                    found.append(f"{where(m.start())}: {m.group(1)} with {len(args)} arguments "
                                 "formats them through a stream; pass one ready std::string "
                                 "(std::to_string for numbers)")
    return found


def main() -> int:
    found = problems(pathlib.Path(sys.argv[1]))
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
