"""registry.config_name: the registered name a component's config carries, whatever its shape."""

import argparse
from dataclasses import dataclass

from omegaconf import OmegaConf

from fairseq.registry import config_name


@dataclass
class _Instance:
    _name: str = "on_the_instance"


class _ClassAttribute:  # a plug-in config whose name is a class attribute
    _name = "on_the_class"


@dataclass(slots=True)
class _Slots:
    _name: str = "slotted"


def test_config_name_reads_every_shape():
    assert config_name(_Instance()) == "on_the_instance"
    assert config_name(_ClassAttribute()) == "on_the_class"
    assert config_name(_Slots()) == "slotted"
    assert config_name(OmegaConf.create({"_name": "dict_config"})) == "dict_config"
    assert config_name({"_name": "mapping"}) == "mapping"
    assert config_name(argparse.Namespace(task="language_modeling"), "task") == "language_modeling"
    assert config_name(argparse.Namespace(), "task") is None
    assert config_name(None) is None
