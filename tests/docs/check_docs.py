#!/usr/bin/env python3
"""The docs hold together: their links resolve and the flags they name exist.

Usage: check_docs.py [SOURCE_DIR]   (default: the tree this file is in)

Reads README.md, docs/*.md and bench/README.md and checks that
  1. every relative markdown link ([text](path), [text](path#anchor), [text](#anchor)) names a
     file or folder that exists, and that an #anchor into a .md file names one of its headings,
     as GitHub makes anchors of headings (lower case, punctuation dropped, spaces to hyphens,
     -1, -2, ... after a repeated one);
  2. every command-line flag shown in code (`inline` spans, which may run over a line break, and
     fenced blocks) that looks like --some-flag is defined in the sources: the literal
     "--some-flag" somewhere in a .cc/.h/.c/.py/.sh file or an extensionless #! script under
     src/, include/, tools/, examples/, python/, scripts/ or bench/, or a member of the
     Trainer's argument table (LOCKSTEP_TRAINING_ARGUMENTS in
     include/lockstep/train_core/arguments.h, whose flags are made from the member names).
     Dashes and underscores count as the same: lockstep's programs, as torchrun, take both.
     Flags of other programs (ctest, srun, mpirun, ...) are allow-listed in FOREIGN_FLAGS.
Prints every problem as FILE:LINE: ... and exits 1 when there is one. Standard library only;
run by ctest as Docs.LinksResolveAndFlagsExist (tests/CMakeLists.txt).
"""
import os
import re
import sys
import unicodedata

DOC_FILES = ["README.md", "bench/README.md"]
DOC_DIR = "docs"
SOURCE_DIRS = ["src", "include", "tools", "examples", "python", "scripts", "bench"]
SOURCE_EXTS = {".cc", ".h", ".c", ".cpp", ".py", ".sh"}
TRAINER_ARGUMENTS = "include/lockstep/train_core/arguments.h"

# Flags the docs name that belong to other programs. Each with its owner.
FOREIGN_FLAGS = {
    "--install": "cmake --install",
    "--no-build-isolation": "pip install and pip wheel",
    "--input": "SentencePiece's spm_train",
    "--model_prefix": "SentencePiece's spm_train",
    "--vocab_size": "SentencePiece's spm_train",
    "--model_type": "SentencePiece's spm_train",
    "--prefix": "cmake --install --prefix",
    "--test-dir": "ctest --test-dir",
    "--output-on-failure": "ctest --output-on-failure",
    "--no-as-needed": "the linker (ld), in docs/architecture.md on how libgloo is linked first",
    "--nodes": "Slurm's srun and sbatch",
    "--ntasks-per-node": "Slurm's srun and sbatch",
    "--host": "Open MPI's mpirun",
}

FLAG = re.compile(r"(?<![\w-])--[A-Za-z0-9][A-Za-z0-9_-]*[A-Za-z0-9]")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
ARGUMENT_MEMBER = re.compile(r"^\s*X\(\s*[\w:<>]+\s*,\s*(\w+)\s*,")


def normalise(flag):
    return flag.replace("_", "-")


def doc_files(root):
    files = [f for f in DOC_FILES if os.path.isfile(os.path.join(root, f))]
    docs = os.path.join(root, DOC_DIR)
    if os.path.isdir(docs):
        files += sorted(os.path.join(DOC_DIR, f) for f in os.listdir(docs) if f.endswith(".md"))
    return files


def is_script(path):
    """An extensionless file that starts with #! (scripts/test, bench/compare, ...)."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def known_flags(root):
    known = set()
    for d in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, d)):
            dirnames[:] = [n for n in dirnames if not n.startswith(".") and n != "__pycache__"]
            for name in filenames:
                path = os.path.join(dirpath, name)
                ext = os.path.splitext(name)[1]
                if ext not in SOURCE_EXTS and not (ext == "" and is_script(path)):
                    continue
                with open(path, encoding="utf-8", errors="replace") as f:
                    known.update(normalise(m) for m in FLAG.findall(f.read()))
    # The Trainer's flags are its argument table's member names, dashed (arguments.cc's flag_name).
    table = os.path.join(root, TRAINER_ARGUMENTS)
    if os.path.isfile(table):
        with open(table, encoding="utf-8") as f:
            for line in f:
                m = ARGUMENT_MEMBER.match(line)
                if m:
                    known.add("--" + normalise(m.group(1)))
    return known


def blocks(lines):
    """The file as (first line number, text outside code, [(line number, code)]) per paragraph.

    A fenced block is all code; elsewhere a paragraph (lines up to a blank one or a fence) is
    searched as a whole, since a code span or a link may run over a line break. In the text
    outside code each span is replaced by its line breaks, so offsets still give line numbers."""
    out = []
    paragraph = []  # (line number, text)

    def flush():
        if not paragraph:
            return
        first = paragraph[0][0]
        text = "\n".join(t for _, t in paragraph)
        code = []
        for m in CODE_SPAN.finditer(text):
            code.append((first + text.count("\n", 0, m.start()), m.group(2)))
        outside = CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        out.append((first, outside, code))
        paragraph.clear()

    fence = None
    for no, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1) == fence:
                fence = None
            else:
                out.append((no, "", [(no, line)]))
            continue
        if m:
            flush()
            fence = m.group(1)
            continue
        if not line.strip():
            flush()
            continue
        paragraph.append((no, line))
    flush()
    return out


def slug(heading):
    """GitHub's anchor for a heading: its text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    out = []
    for ch in text:
        if ch == " ":
            out.append("-")
        elif ch in "-_" or unicodedata.category(ch)[0] in "LN":
            out.append(ch)
    return "".join(out)


_anchors = {}


def anchors_of(path):
    if path not in _anchors:
        seen, anchors, fence = {}, set(), None
        with open(path, encoding="utf-8") as f:
            for line in f.read().splitlines():
                m = FENCE.match(line)
                if fence:
                    if m and m.group(1) == fence:
                        fence = None
                    continue
                if m:
                    fence = m.group(1)
                    continue
                h = HEADING.match(line)
                if h:
                    base = slug(h.group(2))
                    n = seen.get(base, 0)
                    anchors.add(base if n == 0 else f"{base}-{n}")
                    seen[base] = n + 1
        _anchors[path] = anchors
    return _anchors[path]


def check_links(root, rel, parsed, problems):
    here = os.path.dirname(os.path.join(root, rel))
    for first, outside, _ in parsed:
        for m in LINK.finditer(outside):
            no = first + outside.count("\n", 0, m.start())
            target = m.group(1)
            if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(here, path)) if path else os.path.join(root, rel)
            shown = os.path.relpath(full, root)
            if not os.path.exists(full):
                problems.append(f"{rel}:{no}: link to {target}: {shown} does not exist")
            elif anchor and full.endswith(".md") and os.path.isfile(full) and anchor not in anchors_of(full):
                problems.append(f"{rel}:{no}: link to {target}: {shown} has no heading whose anchor is #{anchor}")


def check_flags(rel, parsed, known, problems):
    for _, _, code in parsed:
        for no, piece in code:
            for flag in FLAG.findall(piece):
                if flag not in FOREIGN_FLAGS and normalise(flag) not in known:
                    problems.append(f"{rel}:{no}: {flag} is defined nowhere in {', '.join(SOURCE_DIRS)}: a lockstep "
                                    f"flag that does not exist, or another program's (then add it to FOREIGN_FLAGS "
                                    f"in tests/docs/check_docs.py)")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", ".."))
    known = known_flags(root)
    problems = []
    files = doc_files(root)
    for rel in files:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            parsed = blocks(f.read().splitlines())
        check_links(root, rel, parsed, problems)
        check_flags(rel, parsed, known, problems)
    for p in problems:
        print(p)
    if problems:
        print(f"check_docs: {len(problems)} problem(s) in {len(files)} files")
        return 1
    print(f"check_docs: {len(files)} files: every link resolves and every flag exists ({len(known)} flags known)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
