"""The compiled part of taproom: its ZeroMQ burst module, ``taproom.zmqburst._burst``, built by
cffi in API mode from src/taproom/zmqburst/burst.c (everything else is in pyproject.toml).

The extension is optional: on a machine without a C compiler or Python headers the install
goes on and taproom runs on the pure-Python path (``taproom.zmqburst.ext_status()`` says why).
"""

from setuptools import setup

setup(cffi_modules=["src/taproom/zmqburst/_build.py:ffibuilder"])
