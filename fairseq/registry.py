"""One generic registry for every pluggable component (tasks, models, criterions, ...).

A component registers itself with a decorator and, optionally, the dataclass that holds its
configuration; the dataclass is what generates the component's command-line flags.
Built-in components live in known packages that are imported the first time a registry is read,
so `import fairseq` stays cheap.
"""

import importlib
import os
import pkgutil
import sys
from collections.abc import Mapping
from dataclasses import is_dataclass
from typing import Callable, Dict, Optional, Type

from fairseq.suggest import did_you_mean


def config_name(cfg, legacy_key: Optional[str] = None):
    """The registered name a component's config carries: its `_name`, else (for upstream's argparse namespace)
    its `legacy_key` attribute (`task`, `arch`). The one optional read of it: upstream's namespaces, legacy
    plug-ins' configs and plug-in dataclasses that do not extend FairseqDataclass have no `_name`. A config is
    read as a mapping (an omegaconf DictConfig) or by attribute (a dataclass, a namespace; a plug-in's `_name`
    may be a class attribute, or its dataclass may use slots)."""
    if cfg is None:
        return None

    def read(key):
        return cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key, None)

    name = read("_name")
    if not name and legacy_key is not None:
        name = read(legacy_key)
    return name


class Registry:
    def __init__(self, kind: str, packages: tuple, flag: str, base_class: Optional[str] = None):
        self.kind = kind
        self.flag = flag  # the command-line flag that selects a component, e.g. --task
        # "module.Class" that every registered class must extend; imported on first use (the base classes'
        # packages import this module).
        self._base_class = base_class
        self._packages = packages
        self._classes: Dict[str, type] = {}
        self._dataclasses: Dict[str, type] = {}
        self._loaded = False

    def register(self, name: str, dataclass: Optional[type] = None) -> Callable[[type], type]:
        def wrap(cls):
            if name in self._classes:
                raise ValueError(f"cannot register duplicate {self.kind} {name!r}")
            base = self.base_class
            if base is not None and not (isinstance(cls, type) and issubclass(cls, base)):
                raise ValueError(
                    f"{self.kind} {name!r} ({getattr(cls, '__name__', cls)}) must extend "
                    f"{base.__module__}.{base.__name__}"
                )
            if dataclass is not None and not is_dataclass(dataclass):
                raise ValueError(f"{self.kind} {name!r}: {dataclass} is not a dataclass")
            self._classes[name] = cls
            if dataclass is not None:
                self._dataclasses[name] = dataclass
            # Set even when None: a subclass registered without a dataclass is configured by its own add_args
            # (upstream's legacy components), not by the dataclass of the class it extends.
            cls.config_class = dataclass
            cls.registry_name = name
            return cls

        return wrap

    @property
    def base_class(self) -> Optional[type]:
        if self._base_class is None:
            return None
        module, name = self._base_class.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)

    def _load_builtins(self):
        if self._loaded:
            return
        self._loaded = True
        for package in self._packages:
            import_package_modules(package)

    def get(self, name: str) -> type:
        self._load_builtins()
        if name not in self._classes:
            raise ValueError(
                f"unknown {self.kind} {name!r} for {self.flag}{did_you_mean(name, self.choices())}; choose one of: "
                f"{', '.join(self.choices())}"
                " (or load a plug-in with --user-dir)"
            )
        return self._classes[name]

    def dataclass(self, name: str) -> Optional[type]:
        self.get(name)
        return self._dataclasses.get(name)

    def choices(self):
        self._load_builtins()
        return sorted(self._classes)

    def __contains__(self, name):
        self._load_builtins()
        return name in self._classes


def import_package_modules(package: str):
    """Import every module of `package` (one level deep, plus sub-packages) so their decorators run."""
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")


TASK_REGISTRY = Registry("task", ("fairseq.tasks",), "--task")
MODEL_REGISTRY = Registry(
    "model", ("fairseq.models",), "--arch", base_class="fairseq.models.fairseq_model.BaseFairseqModel"
)
CRITERION_REGISTRY = Registry("criterion", ("fairseq.criterions",), "--criterion")
OPTIMIZER_REGISTRY = Registry("optimizer", ("fairseq.optim",), "--optimizer")
LR_SCHEDULER_REGISTRY = Registry("lr_scheduler", ("fairseq.optim.lr_scheduler",), "--lr-scheduler")


class EncoderRegistry(Registry):
    """The --bpe / --tokenizer registries (schemes in fairseq.data.encoders), also readable as upstream's plain dicts were (`"gpt2" in BPE_REGISTRY`,
    `BPE_REGISTRY["gpt2"]`, `BPE_REGISTRY.keys()`)."""

    def __getitem__(self, name):
        self._load_builtins()
        return self._classes[name]

    def __iter__(self):
        return iter(self.choices())

    def __len__(self):
        return len(self.choices())

    def keys(self):
        return self.choices()

    def items(self):
        return [(name, self.get(name)) for name in self.choices()]

    def name_of_config(self, cfg):
        """The registered name whose config dataclass `cfg` is an instance of (exact type), or None."""
        self._load_builtins()
        names = [n for n, dc in self._dataclasses.items() if type(cfg) is dc]
        return names[0] if len(names) == 1 else None


BPE_REGISTRY = EncoderRegistry("bpe", ("fairseq.data.encoders",), "--bpe")
TOKENIZER_REGISTRY = EncoderRegistry("tokenizer", ("fairseq.data.encoders",), "--tokenizer")

# Architectures: name -> model class, and name -> function that fills unset hyper-parameters.
ARCH_MODEL_REGISTRY: Dict[str, type] = {}
ARCH_CONFIG_REGISTRY: Dict[str, Callable] = {}

register_task = TASK_REGISTRY.register
register_criterion = CRITERION_REGISTRY.register
register_optimizer = OPTIMIZER_REGISTRY.register
register_lr_scheduler = LR_SCHEDULER_REGISTRY.register
register_model = MODEL_REGISTRY.register


def register_model_architecture(model_name: str, arch_name: str):
    """Register a named preset of a model: `fn(args)` sets only the hyper-parameters still unset."""

    def wrap(fn):
        if arch_name in ARCH_MODEL_REGISTRY:
            raise ValueError(f"cannot register duplicate architecture {arch_name!r}")
        if model_name not in MODEL_REGISTRY._classes:
            raise ValueError(f"architecture {arch_name!r} names unknown model {model_name!r}")
        ARCH_MODEL_REGISTRY[arch_name] = MODEL_REGISTRY._classes[model_name]
        ARCH_CONFIG_REGISTRY[arch_name] = fn
        return fn

    return wrap


def architectures():
    MODEL_REGISTRY._load_builtins()
    return sorted(ARCH_MODEL_REGISTRY)


def arch_model(arch: str) -> type:
    MODEL_REGISTRY._load_builtins()
    if arch not in ARCH_MODEL_REGISTRY:
        raise ValueError(
            f"unknown architecture {arch!r} for --arch{did_you_mean(arch, architectures())}; choose one of: "
            f"{', '.join(architectures())}"
            " (or load a plug-in with --user-dir)"
        )
    return ARCH_MODEL_REGISTRY[arch]


def dataclass_of(cls) -> Optional[Type]:
    return getattr(cls, "config_class", None)


def import_user_module(user_dir):
    """Import a plug-in directory (--user-dir, a Python package) so that its register_* decorators run. Upstream
    passes a config or namespace with a `user_dir` attribute (None: nothing to import); a path works too."""
    if not isinstance(user_dir, (str, os.PathLike)):
        user_dir = getattr(user_dir, "user_dir", None)
        if user_dir is None:
            return
    path = os.path.abspath(os.path.expanduser(user_dir))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--user-dir {user_dir!r}: no such directory")
    parent, name = os.path.split(path)
    if name in sys.modules:
        loaded = getattr(sys.modules[name], "__file__", None) or ""
        if os.path.dirname(os.path.abspath(loaded)) == path:
            return  # already imported
        raise ImportError(
            f"--user-dir {user_dir!r}: a module named {name!r} is already imported from elsewhere; rename the directory"
        )
    sys.path.insert(0, parent)
    try:
        importlib.import_module(name)
    finally:
        sys.path.remove(parent)
