"""Reads the test beds' code and scripts and lists the host commands they run, for
tests/unit/test_hostreqs.py: Python by its syntax tree, shell (scripts, Makefile recipes) by a
word scan. What counts as a host command is the rule in tests/testbed/hostreqs.py: a bare
name resolved on PATH, or an absolute path; a path computed at run time (from the cache, from
`sys.executable`) is the project's own program.

Python, the places a command is named:
- the argv of `subprocess.run/Popen/check_call/check_output/call`, of `Launcher.start/launch`
  (its second argument), and the first argument of the beds' wrappers that run a command
  (`hostnet.run("nft", ...)`, `_out("ip", ...)`, `hostreqs.command_path("zstd")`);
- `shutil.which("x")`;
- the program after `unshare`/`nsenter` options, and a script after `sh -c`;
- argv elements are followed through local and module assignments, `for` loops over literal
  tuples and f-strings made of those (`f"{ipt}-save"`); anything else is computed.
Shell: the word in command position of each simple command, after assignments and keywords;
`command -v x` names x; `$(...)` is scanned too. Scripts a bed runs inside an image (the
image-build steps, the smoke checks) run the image's commands, not the host's: not scanned.
"""

from __future__ import annotations

import ast
import itertools
import re
import shlex
from collections.abc import Iterable, Iterator
from pathlib import Path

PROCESS_CALLS = {"run", "Popen", "check_call", "check_output", "call"}
LAUNCH_CALLS = {"start", "launch"}  # procs.Launcher: (name, argv, ...)
PREFIX_COMMANDS = {"unshare", "nsenter"}  # run the program after their options
OPTIONS_WITH_VALUES = {"--propagation"}
SHELL_KEYWORDS = {
    "if", "then", "else", "elif", "fi", "for", "in", "do", "done", "while", "until", "case",
    "esac", "function", "{", "}", "!", "[[", "]]", "[", "]", "exec", "time",
}  # fmt: skip
SHELL_BUILTINS = {
    "set", "cd", "echo", "export", "local", "return", "exit", "shift", "trap", "true", "false",
    "test", "read", "printf", "source", ".", "eval", "wait", "kill", "ulimit", "type",
    "declare", "unset", "break", "continue", ":", "command",
}  # fmt: skip
SEPARATORS = {";", "&&", "||", "|", "&", "(", "((", "$(", "`", ";;"}
WORD = re.compile(r"^[A-Za-z0-9_./+-]+$")


class Computed:
    """A value the scan cannot know from the source: not a literal command."""


COMPUTED = Computed()


def classify(word: str) -> str | None:
    """A host command's name or absolute path, or None for what is not one (a relative path
    to the project's own file, an option, an expansion)."""
    if not WORD.match(word) or word.startswith("-"):
        return None
    if "/" in word:
        return word if word.startswith("/") else None
    return word


# --- Python -----------------------------------------------------------------------------------
class _Module:
    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node

    def scope(self, node: ast.AST) -> list[ast.AST]:
        """The enclosing function(s) and the module, innermost first."""
        out: list[ast.AST] = []
        cur: ast.AST | None = node
        while cur is not None:
            if isinstance(cur, ast.FunctionDef | ast.AsyncFunctionDef | ast.Module):
                out.append(cur)
            cur = self.parent.get(cur)
        return out

    def bindings(self, name: str, at: ast.AST) -> list[ast.AST]:
        """Values bound to `name` in the scopes around `at` (assignments, loop items)."""
        for scope in self.scope(at):
            nodes = ast.walk(scope) if not isinstance(scope, ast.Module) else iter(scope.body)
            found: list[ast.AST] = []
            for node in nodes:
                if isinstance(node, ast.Assign):
                    if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                        found.append(node.value)
                elif isinstance(node, ast.AnnAssign) and node.value is not None:
                    if isinstance(node.target, ast.Name) and node.target.id == name:
                        found.append(node.value)
                elif (isinstance(node, ast.For) and isinstance(node.target, ast.Name)
                      and node.target.id == name and isinstance(node.iter, ast.Tuple | ast.List)):
                    found += node.iter.elts
            if found:
                return found
        return []

    def strings(self, node: ast.AST, depth: int = 0) -> set[str] | Computed:
        """Every string `node` may be, or COMPUTED."""
        if depth > 8:
            return COMPUTED
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Name):
            values = self.bindings(node.id, node)
            return self._union([self.strings(v, depth + 1) for v in values]) if values else COMPUTED
        if isinstance(node, ast.JoinedStr):
            parts: list[set[str]] = []
            for v in node.values:
                got = self.strings(v.value if isinstance(v, ast.FormattedValue) else v, depth + 1)
                if isinstance(got, Computed):
                    return COMPUTED
                parts.append(got)
            return {"".join(p) for p in itertools.product(*parts)}
        return COMPUTED

    def argvs(self, node: ast.AST, depth: int = 0) -> list[list[ast.expr]]:
        """The literal argv lists `node` may be (a list, a name bound to one, a + b)."""
        if depth > 8:
            return []
        if isinstance(node, ast.List | ast.Tuple):
            return [list(node.elts)]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.argvs(node.left, depth + 1)
        if isinstance(node, ast.Call) and _name(node.func) == "list" and node.args:
            return self.argvs(node.args[0], depth + 1)
        if isinstance(node, ast.Name):
            return [a for v in self.bindings(node.id, node) for a in self.argvs(v, depth + 1)]
        return []

    @staticmethod
    def _union(sets: list[set[str] | Computed]) -> set[str] | Computed:
        known = [s for s in sets if not isinstance(s, Computed)]
        return set().union(*known) if known else COMPUTED


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _argv_commands(mod: _Module, argv: list[ast.expr]) -> Iterator[str]:
    """The commands one argv runs: its program, and what unshare, nsenter or sh -c run."""
    if not argv or isinstance(argv[0], ast.Starred):
        return
    first = mod.strings(argv[0])
    if isinstance(first, Computed):
        return
    yield from first
    rest = argv[1:]
    if first & PREFIX_COMMANDS:
        words = [None if isinstance(a, ast.Starred) else mod.strings(a) for a in rest]
        flat = [next(iter(w)) if isinstance(w, set) and len(w) == 1 else None for w in words]
        if "--" in flat:
            after = rest[flat.index("--") + 1:]
        else:
            skip, after = False, []
            for i, w in enumerate(flat):
                if skip:
                    skip = False
                elif w is not None and w.startswith("-"):
                    skip = w in OPTIONS_WITH_VALUES
                else:
                    after = rest[i:]
                    break
        yield from _argv_commands(mod, after)
    elif first & {"sh", "bash"} and len(rest) >= 2:
        flag = mod.strings(rest[0])
        if isinstance(flag, set) and flag == {"-c"}:
            script = mod.strings(rest[1])
            if isinstance(script, set):
                for text in script:
                    yield from shell_commands(text)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    names = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def _is_param(node: ast.expr, name: str) -> bool:
    if isinstance(node, ast.Call) and _name(node.func) == "list" and node.args:
        node = node.args[0]
    return isinstance(node, ast.Name) and node.id == name


class Wrappers:
    """Functions of the scanned code that run what their caller passes: `run(*argv)` (the
    call's arguments are the argv), `_run_logged(cmd, ...)` (an argv argument),
    `command_path(name)` (a command argument: it goes to `which` or argv[0])."""

    def __init__(self) -> None:
        self.kinds: dict[str, tuple[str, int]] = {}  # name -> ("varargv"|"argv"|"command", i)

    def learn(self, tree: ast.Module) -> bool:
        """Add the wrappers defined in `tree`; True when any was new."""
        before = dict(self.kinds)
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            params, vararg = _params(fn), fn.args.vararg
            for call in ast.walk(fn):
                if not isinstance(call, ast.Call) or not call.args:
                    continue
                for kind, node in self._slots(call):
                    if vararg is not None and kind == "argv" and _is_param(node, vararg.arg):
                        self.kinds.setdefault(fn.name, ("varargv", 0))
                    for i, p in enumerate(params):
                        if _is_param(node, p):
                            self.kinds.setdefault(fn.name, (kind, i))
                        elif kind == "argv" and isinstance(node, ast.List) and node.elts \
                                and _is_param(node.elts[0], p):
                            self.kinds.setdefault(fn.name, ("command", i))
        return self.kinds != before

    def _slots(self, call: ast.Call) -> Iterator[tuple[str, ast.expr]]:
        """(what it is, the argument) for each argument of `call` that is run."""
        name, args = _name(call.func), call.args
        if name == "which":
            yield "command", args[0]
        if name in PROCESS_CALLS:
            yield "argv", args[0]
        if name in LAUNCH_CALLS and len(args) >= 2:
            yield "argv", args[1]
        kind = self.kinds.get(name or "")
        if kind and kind[0] != "varargv" and len(args) > kind[1]:
            yield kind[0], args[kind[1]]


def python_commands(source: str, wrappers: Wrappers | None = None) -> set[str]:
    """The host commands (names and absolute paths) a Python module runs."""
    mod = _Module(ast.parse(source))
    if wrappers is None:
        wrappers = Wrappers()
        while wrappers.learn(mod.tree):
            pass
    found: set[str] = set()
    for node in ast.walk(mod.tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        kind = wrappers.kinds.get(_name(node.func) or "")
        if kind and kind[0] == "varargv" and not isinstance(node.args[0], ast.Starred):
            found.update(_argv_commands(mod, list(node.args)))
        for what, arg in wrappers._slots(node):
            if what == "command":
                got = mod.strings(arg)
                found |= got if isinstance(got, set) else set()
            else:
                for argv in mod.argvs(arg):
                    found.update(_argv_commands(mod, argv))
    return {c for word in found if (c := classify(word))}


# --- shell ------------------------------------------------------------------------------------
def _tokens(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()`<>")
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote: the plain words are good enough
        return line.split()


def _substitutions(token: str) -> Iterator[str]:
    """The text of each `$(...)` inside a word (quotes took the parentheses along)."""
    for m in re.finditer(r"\$\((?!\()", token):
        depth, start = 1, m.end()
        for i in range(start, len(token)):
            depth += {"(": 1, ")": -1}.get(token[i], 0)
            if depth == 0:
                yield token[start:i]
                break
        else:
            yield token[start:]


def shell_commands(text: str) -> set[str]:
    """The host commands a shell script (or a Makefile recipe, made-expanded) runs."""
    found: set[str] = set()
    for line in text.replace("\\\n", " ").splitlines():
        at_start, after_command_v, redirect = True, False, False
        for tok in _tokens(line):
            for inner in _substitutions(tok):
                found |= shell_commands(inner)
            if redirect:  # the file after `>`, `2>&`, `<`
                redirect = False
                continue
            if set(tok) <= set("<>&") and set(tok) & set("<>"):
                redirect = True
                continue
            if tok in SEPARATORS or set(tok) <= set(";&|()`"):
                at_start = True
                continue
            if after_command_v:
                if tok.startswith("-"):
                    continue
                after_command_v = False
                if c := classify(tok):
                    found.add(c)
                continue
            if not at_start:
                continue
            if tok in ("for", "case", "select"):
                at_start = False  # `for x in a b`: words, not commands, up to the separator
                continue
            if re.match(r"^[A-Za-z_][A-Za-z0-9_]*\+?=", tok) or tok in SHELL_KEYWORDS:
                continue  # an assignment or keyword: the command comes next
            at_start = False
            if tok == "command":
                after_command_v = True  # `command -v x`: x is looked for
                continue
            if tok in SHELL_BUILTINS:
                continue
            if c := classify(tok):
                found.add(c)
    return found


def makefile_commands(text: str) -> set[str]:
    """The host commands a Makefile's recipes run, with its own variables expanded."""
    variables: dict[str, str] = {"MAKE": "make"}
    for m in re.finditer(r"^([A-Z_]+)\s*[:?]?=\s*(.*)$", text, re.M):
        variables.setdefault(m.group(1), m.group(2).strip())
    recipes = [ln[1:].lstrip("@-") for ln in text.splitlines() if ln.startswith("\t")]
    found: set[str] = set()
    for line in recipes:
        line = line.replace("$$", "\0")
        for _ in range(10):  # inner references first: $(if $(SIM),--sim) and $(BIN)/python
            new = re.sub(r"\$\(([A-Za-z_]+)\)", lambda m: variables.get(m.group(1), "MAKEVAR"),
                         line)  # fmt: skip
            new = re.sub(r"\$\((if|addprefix|foreach|subst) [^()$]*\)", "", new)
            if new == line:
                break
            line = new
        found |= shell_commands(line.replace("\0", "$"))
    return {c for c in found if c != "MAKEVAR"}


def commands_in(paths: Iterable[Path]) -> dict[str, set[str]]:
    """command -> the files (as given) that run it. Wrappers are learnt from every Python
    file first, so `hostnet.run("nft", ...)` in realbed.py counts."""
    paths = list(paths)
    texts = {p: p.read_text() for p in paths}
    trees = [ast.parse(t) for p, t in texts.items() if p.suffix == ".py"]
    wrappers = Wrappers()
    while any([wrappers.learn(t) for t in trees]):
        pass
    out: dict[str, set[str]] = {}
    for path, text in texts.items():
        if path.suffix == ".py":
            found = python_commands(text, wrappers)
        elif path.name == "Makefile":
            found = makefile_commands(text)
        else:
            found = shell_commands(text)
        for c in found:
            out.setdefault(c, set()).add(str(path))
    return out
