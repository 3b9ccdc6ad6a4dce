"""The installed version of jdp."""

from importlib.metadata import version

__version__ = version("jdp")
