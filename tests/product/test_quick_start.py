"""The README's quick start refers to what the repository holds: the image
it classifies ships, and where that image comes from is said beside it."""

from conftest import REPO


def test_the_quick_starts_image_ships():
    from distributed_mpt.core.data import images
    readme = (REPO / "README.md").read_text()
    command = next(line for line in readme.splitlines()
                   if line.startswith("distributed-mpt-predict"))
    image = REPO / command.split()[-1]
    assert image.is_file(), f"{image} is not in the repository"
    assert images.read_image(str(image)).shape == (128, 128, 3)
    # Where it comes from, and on what terms, is said beside it.
    said = " ".join((REPO / "docs" / "using-the-model.md").read_text().split())
    assert f"`{command.split()[-1]}`" in said and "is test image 6" in said


def test_every_import_the_docs_show_exists():
    """using-the-model.md's samples imported read_image from
    distributed_mpt.predict, which has none: a user's first line failed."""
    import importlib
    import re

    shown = set()
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for module, names in re.findall(r"from (distributed_mpt[\w.]*) import ([\w, ]+)",
                                        page.read_text()):
            shown |= {(page.name, module, name.strip()) for name in names.split(",")}
    assert ("using-the-model.md", "distributed_mpt.core.data.images", "read_image") in shown
    def exists(module, name):  # a name in the module, or a module of the package
        if hasattr(importlib.import_module(module), name):
            return True
        try:
            return bool(importlib.import_module(f"{module}.{name}"))
        except ImportError:
            return False

    missing = [(page, module, name) for page, module, name in sorted(shown)
               if not exists(module, name)]
    assert not missing, missing
