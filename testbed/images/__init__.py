"""Locally built testbed images (no registry): see build.py."""

from testbed.images.build import IMAGES, BuildError, archive, build, image_id

__all__ = ["IMAGES", "BuildError", "archive", "build", "image_id"]
