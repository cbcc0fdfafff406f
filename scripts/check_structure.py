#!/usr/bin/env python
"""The package's structure, measured from its source (no import is run): import circles, imports that run up
the layers of docs/ARCHITECTURE.md (per module and per folder, and folders that import each other), loose
modules at the fairseq/ root, long files and functions, imports inside functions, and `getattr`/`hasattr`
probes of config objects (`cfg`, `self.cfg`, `task.cfg`, `args`, `config`, ...) for a literal field name.

    python scripts/check_structure.py            # a table of the counts and each finding; exit 1 over a limit

Imports inside functions count like top-level ones: a deferred import that closes a circle is still a circle.
An upward import must also be declared, with its reason, in EXCEPTIONS (exit 1 otherwise). Imports the source
does not spell (the registries' importlib of their packages, `python -m`, the compat wing's modules that
`fairseq.compat.load` imports for upstream's names in fairseq.upstream_absent's tables) are not seen: plug-in style
loading by name is how the config layer finds components without importing them; upstream_absent's one import of
the wing is spelled, and declared in EXCEPTIONS.
tests/unit/test_structure.py runs this in the CPU suite, one test per limit.
"""

import argparse
import ast
import os
import re
import sys
from collections import defaultdict
from typing import Dict, Iterator, List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("fairseq", "fairseq_cli")

# Upstream's module names that are faces over the core (`sys.modules[__name__] = <the real module>`) or the
# compat wing: they belong to the top layer, whatever folder they sit in.
UPSTREAM_FACES = (
    "fairseq.checkpoint_utils",
    "fairseq.utils",
    "fairseq.distributed_utils",
    "fairseq.file_io",
    "fairseq.metrics",
    "fairseq.tokenizer",
    "fairseq.trainer",
    "fairseq.hub_utils",
    "fairseq.binarizer",
    "fairseq.file_chunker_utils",
    "fairseq.search",
    "fairseq.sequence_generator",
    "fairseq.sequence_scorer",
    "fairseq.incremental_decoding_utils",
    "fairseq.plan_memory",
    "fairseq.models.fairseq_decoder",
    "fairseq.models.fairseq_incremental_decoder",
    "fairseq.options",
)

# Layers, lowest first: a module may import its own layer and those below, never one above. The most specific
# prefix wins. docs/ARCHITECTURE.md draws the same table.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    # what every layer reads: config dataclasses, the flat-values config builder and flag generator, the
    # registries (components are found by name, imported by package), log lines, kernels, the launch environment
    (
        "config, utilities",
        (
            "fairseq",
            "fairseq.registry",
            "fairseq.upstream_absent",
            "fairseq.dataclass",
            "fairseq.logging",
            "fairseq.kernels",
            "fairseq.runtime",
        ),
    ),
    # the dictionary, datasets, batching, text encoders; fairseq-preprocess's binarizer over them
    ("data, preprocessing", ("fairseq.data", "fairseq.preprocessing")),
    # layers of a network, optimizers and schedulers, losses
    ("modules, optim, criterions", ("fairseq.modules", "fairseq.optim", "fairseq.criterions")),
    ("models", ("fairseq.models",)),
    # search, the sequence generator and scorer: functions of (models, dictionary, GenerationConfig), below the
    # tasks because upstream's task API builds them (task.build_generator)
    ("decoding", ("fairseq.generation",)),
    ("tasks", ("fairseq.tasks",)),
    # applied to a built model and its state: mesh, TP/FSDP/DDP, float8, launch; checkpoint files and resume
    ("distributed, checkpoint", ("fairseq.distributed", "fairseq.checkpoint")),
    # what runs a job: the trainer and its loop, the hub, export, the planner
    (
        "training, generation, export, planning",
        ("fairseq.training", "fairseq.hub", "fairseq.export", "fairseq.planning"),
    ),
    # fairseq-serve's server: HTTP, the scheduler over the decode engine, the served model through the hub
    ("serving", ("fairseq.serving",)),
    # the flag and YAML front ends and validate(cfg), which collects every component's checks
    ("front ends", ("fairseq.frontend",)),
    ("entry points", ("fairseq_cli",)),
    # upstream's API: the wing and the faces at upstream's module names (the core never imports them)
    ("upstream compatibility", ("fairseq.compat", *UPSTREAM_FACES)),
]

# The upward imports allowed, each with why (importer, imported: module names or prefixes). They still count.
EXCEPTIONS: Dict[Tuple[str, str], str] = {
    # upstream's API puts the hub's constructor on the model class; the import runs only when it is called
    ("fairseq.models.fairseq_model", "fairseq.hub.hub_utils"): "BaseFairseqModel.from_pretrained, "
    "upstream's hub entry point",
    # upstream's names inside the core's packages whose code is the wing's (fairseq.modules.MultiheadAttention,
    # fairseq.data.language_pair_dataset, ...): the packages' __getattr__ and the module finder resolve them from
    # fairseq.upstream_absent's tables on first use, through this one import; the core's own work never reaches it
    ("fairseq.upstream_absent", "fairseq.compat"): "upstream's names in the core's packages, served by the wing",
}

# Each limit is what the tree holds (a ratchet: it may only go down); TARGETS are issue 40's goals, printed
# beside the counts, all met since 2026-12-06. (The length limits were raised once that day, when `ruff format`
# first rewrapped the tree, then brought to 0 by splitting files and functions along their seams.)
LIMITS = {
    "circles": 0,
    "upward imports": 2,
    "folders importing up": 1,
    "folders importing each other": 0,
    "root modules over 40 lines": 2,
    "files over 600 lines": 0,
    "files over 500 lines": 0,
    "functions over 80 lines": 0,
    "functions over 60 lines": 0,
    "config getattr/hasattr probes": 4,
    "imports inside functions": 56,
    "undeclared imports inside functions": 0,
}
TARGETS = {
    "folders importing up": 4,
    "folders importing each other": 0,
    "files over 500 lines": 0,
    "functions over 60 lines": 0,
    "config getattr/hasattr probes": 10,
    "imports inside functions": 60,
    "undeclared imports inside functions": 0,
    "files over 600 lines": 0,
    "functions over 80 lines": 0,
}
# Names of the objects that hold configuration: a getattr/hasattr on them for a literal name probes a field
# that a typed config declares (or a namespace that may lack it).
CONFIG_NAMES = ("cfg", "args", "config", "saved_cfg", "model_cfg", "task_cfg")


def module_files(root: str) -> Dict[str, str]:
    mods = {}
    for package in PACKAGES:
        for directory, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    mods[module[: -len(".__init__")] if module.endswith(".__init__") else module] = path
    return mods


def imported_modules(module: str, path: str, tree: ast.AST, mods: Dict[str, str]) -> Iterator[Tuple[str, int]]:
    """(module imported, line) for every import in the file, inside functions too."""

    def known(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = anchor + ("." + base if base else "")
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES:
                target = known(name)
                if target and target != module:
                    yield target, node.lineno


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _under(module, prefix) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best if best is not None else 0


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def exception_for(module: str, target: str):
    """Why the upward import module -> target is allowed (EXCEPTIONS), or None."""
    for (importer, imported), why in EXCEPTIONS.items():
        if (module == importer if importer == "fairseq" else _under(module, importer)) and _under(target, imported):
            return why
    return None


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def long_functions(path: str, tree: ast.AST, limit: int) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                yield f"{path}:{node.lineno} {node.name} ({length} lines)"


def _is_config(target: ast.AST) -> bool:
    """`cfg`, `args`, `config` (and the other CONFIG_NAMES), or an attribute chain through one of them or ending
    in one (`self.cfg`, `task.cfg`, `cfg.model`, `self.args.task`)."""
    names = []
    while isinstance(target, ast.Attribute):
        names.append(target.attr)
        target = target.value
    if isinstance(target, ast.Name):
        names.append(target.id)
    return any(name.lower() in CONFIG_NAMES or name.lower().endswith("_cfg") for name in names)


def config_probes(path: str, tree: ast.AST) -> Iterator[str]:
    """getattr(<config>, "literal", ...) and hasattr(<config>, "literal") calls."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_config(node.args[0])
        ):
            yield f"{path}:{node.lineno} {node.func.id}({ast.unparse(node.args[0])}, {node.args[1].value!r})"


# The reasons an import may sit inside a function, declared on its line as `# deferred: <reason>`:
DEFERRED_REASONS = {
    "optional": "a package of an extra or an API a torch version may lack (transformers, triton, torchao, yaml...)",
    "startup": "heavy, and off the import path of a command or process that does not need it",
    "upward": "a declared upward import (EXCEPTIONS): it runs when called, after both layers are loaded",
}
DEFERRED = re.compile(r"#.*\bdeferred: (\w+)")


def imports_in_functions(path: str, tree: ast.AST, source_lines: List[str]) -> Iterator[Tuple[str, bool]]:
    """(finding, declared) for each import statement inside a function body (a deferred import: a hidden circle,
    an optional package, start-up cost); declared when its first line says `# deferred: <reason>` with a reason
    of DEFERRED_REASONS."""
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and _innermost_function(function, node):
                    names = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                    reason = DEFERRED.search(source_lines[node.lineno - 1])
                    declared = bool(reason) and reason.group(1) in DEFERRED_REASONS
                    yield f"{path}:{node.lineno} {function.name}: {'.' * getattr(node, 'level', 0)}{names}", declared


def _innermost_function(function: ast.AST, node: ast.AST) -> bool:
    """Whether `node` belongs to `function` itself, not to a function nested in it (counted once)."""
    for child in ast.iter_child_nodes(function):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if any(n is node for n in ast.walk(child)):
                return False
        elif any(n is node for n in ast.walk(child)):
            return True
    return False


def folder_of(module: str) -> str:
    """The folder a module sits in, as a reviewer counts them: `fairseq.checkpoint.io` -> `fairseq.checkpoint`,
    the package roots' own modules -> `fairseq` / `fairseq_cli`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def folder_findings(graph: Dict[str, Set[str]], mods: Dict[str, str]) -> Tuple[List[str], List[str]]:
    """(folder imports that run up, pairs of folders importing each other); a folder's layer is the lowest layer
    of its modules, so a folder is 'up' from another when every module of it sits higher."""
    packages = {m for m, p in mods.items() if p.endswith("__init__.py")}
    layer = defaultdict(lambda: len(LAYERS))
    for module in mods:
        folder = folder_of(module) if module not in packages or module.count(".") > 1 else module
        layer[folder] = min(layer[folder], layer_of(module))
    arrows = defaultdict(set)
    for module, targets in graph.items():
        for target in targets:
            a, b = folder_of(module), folder_of(target)
            if a != b and a != "fairseq" and b != "fairseq":
                arrows[a].add(b)
    up = [f"{a} -> {b}" for a in sorted(arrows) for b in sorted(arrows[a]) if layer[b] > layer[a]]
    mutual = [f"{a} <-> {b}" for a in sorted(arrows) for b in sorted(arrows[a]) if a < b and a in arrows[b]]
    return up, mutual


def measure(root: str = ROOT) -> Dict[str, List[str]]:
    mods = module_files(root)
    graph: Dict[str, Set[str]] = defaultdict(set)
    findings: Dict[str, List[str]] = {key: [] for key in LIMITS}
    for module, path in sorted(mods.items()):
        rel = os.path.relpath(path, root)
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source, filename=rel)
        lines = source.count("\n")
        for target, line in imported_modules(module, path, tree, mods):
            if target in graph[module]:
                continue  # one finding per pair of modules
            graph[module].add(target)
            if layer_of(target) > layer_of(module):
                why = exception_for(module, target)
                findings["upward imports"].append(
                    f"{rel}:{line} {module} ({LAYERS[layer_of(module)][0]}) -> {target} "
                    f"({LAYERS[layer_of(target)][0]}): " + (f"declared, {why}" if why else "UNDECLARED")
                )
        loose = module.count(".") == 1 and module.startswith("fairseq.") and not path.endswith("__init__.py")
        if loose and lines > 40:
            findings["root modules over 40 lines"].append(f"{rel} ({lines} lines)")
        for limit in (500, 600):
            if lines > limit:
                findings[f"files over {limit} lines"].append(f"{rel} ({lines} lines)")
        for limit in (60, 80):
            findings[f"functions over {limit} lines"].extend(long_functions(rel, tree, limit))
        findings["config getattr/hasattr probes"].extend(config_probes(rel, tree))
        for finding, declared in imports_in_functions(rel, tree, source.splitlines()):
            findings["imports inside functions"].append(finding)
            if not declared:
                findings["undeclared imports inside functions"].append(finding)
    # A declared upward import is deferred by design (it runs when called, after both modules are loaded): the
    # circle it closes is the declaration's, listed under upward imports with its reason, not counted again.
    undeclared = {module: {t for t in targets if exception_for(module, t) is None} for module, targets in graph.items()}
    findings["circles"] = [" <-> ".join(component) for component in circles(undeclared)]
    findings["folders importing up"], findings["folders importing each other"] = folder_findings(graph, mods)
    return findings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default=ROOT, help="the checkout to measure (default: this one)")
    args = parser.parse_args(argv)
    findings = measure(args.root)
    over = False
    print(f"{'what':32s} {'count':>6s} {'limit':>6s} {'target':>6s}")
    for key, limit in LIMITS.items():
        flag = "" if len(findings[key]) <= limit else "  OVER"
        over |= bool(flag)
        print(f"{key:32s} {len(findings[key]):6d} {limit:6d} {TARGETS.get(key, limit):6d}{flag}")
    over |= any(item.endswith("UNDECLARED") for item in findings["upward imports"])
    for key, items in findings.items():
        if items:
            print(f"\n{key}:")
            for item in items:
                print(f"  {item}")
    return 1 if over else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head`: stop quietly, as a filter should
        os._exit(1)
