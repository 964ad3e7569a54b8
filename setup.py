"""The one compiled part: vitcli.data.decoding._jpeg_region, a crop-only JPEG decoder over the system's libjpeg-turbo.

Optional: where no C compiler or no jpeglib.h (Debian's libjpeg-dev) is found, the build skips it with a
warning and vitcli decodes whole images instead (vitcli.data.decoding.jpeg_region answers None). An editable install
(`pip install -e .`, `make setup`) builds it in place, beside its source. Everything else is pyproject.toml's.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("vitcli.data.decoding._jpeg_region", ["src/vitcli/data/decoding/_jpeg_region.c"],
                             libraries=["jpeg"], optional=True)])
