"""The user's own labelled images, one folder per class
(`--dataset=image_folder --data_dir=DIR`): trained as CIFAR-10 is, every
test image evaluated once across replicas, the folders' class names in the
export and in predict's answers; a damaged or foreign file refused by name
before any training."""

import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from conftest import (SMALL_MODEL, assert_ok, assert_one_error_line, read_summary, run_in_process,
                      snapshot, train)
from distributed_mpt import train as train_entry_point
from distributed_mpt.core.data import dataset

CLASSES = ("cars", "dogs", "ships")  # sorted: labels 0, 1, 2
COLOURS = {"cars": (220, 40, 40), "dogs": (40, 200, 60), "ships": (30, 60, 220)}


def _photo(path, colour, rng, size=(30, 40)):
    """A photo of another size than the model takes: a class colour and noise."""
    noise = rng.integers(-60, 60, (*size, 3))
    Image.fromarray(np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)).save(path)


def write_folder(root, train_per_class=24, test_per_class=6, test=True, extension="png"):
    rng = np.random.default_rng(0)
    for split, count in (("train", train_per_class), ("test", test_per_class if test else 0)):
        for name in CLASSES:
            if count:
                (root / split / name).mkdir(parents=True)
            for i in range(count):
                _photo(root / split / name / f"{i:03d}.{extension}", COLOURS[name], rng)
    return root


FLAGS = ["--dataset=image_folder", "--image_size=16", *SMALL_MODEL, "--precision=float32",
         "--per_replica_batch_size=12", "--warmup_epochs=0", "--weight_decay=0",
         "--label_smoothing=0", "--train_steps=24", "--steps_per_loop=6"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("photos"))


def test_an_image_folder_trains_and_predict_names_its_classes(folder, tmp_path):
    run = tmp_path / "run"
    assert_ok(train([*FLAGS, f"--data_dir={folder}", f"--model_dir={run}"]))
    summary = read_summary(run)
    assert summary["dataset"] == "image_folder" and summary["eval_examples"] == 18
    assert summary["eval_accuracy"] > 0.6, "three colours are learnable in 24 steps"
    assert (run / "export" / "classes.txt").read_text().splitlines() == list(CLASSES)
    info = json.loads((run / "export" / "model_info.json").read_text())
    assert info["image_size"] == 16

    from distributed_mpt.predict import main
    photo = folder / "test" / "ships" / "000.png"
    result = run_in_process(main, [f"--model_dir={run}", str(photo)])
    assert_ok(result)
    assert result.stdout.startswith(f"{photo}: ") and result.stdout.split()[1] in CLASSES
    evaluated = run_in_process(main, [f"--model_dir={run}", "--evaluate", f"--data_dir={folder}"])
    assert_ok(evaluated)
    assert "image_folder test:" in evaluated.stdout and "(18 images)" in evaluated.stdout


@pytest.mark.slow
def test_two_replicas_evaluate_every_test_image_once(folder, tmp_path):
    run = tmp_path / "run"
    assert_ok(train([*FLAGS, f"--data_dir={folder}", "--strategy=mirrored", "--cpu_replicas=2",
                     "--per_replica_batch_size=6", "--noexport", f"--model_dir={run}"]))
    summary = read_summary(run)
    assert (summary["num_replicas"], summary["eval_examples"]) == (2, 18)


def test_a_folder_without_test_holds_out_a_stated_fraction(tmp_path):
    folder = write_folder(tmp_path / "photos", test=False)
    run = tmp_path / "run"
    assert_one_error_line(train([*FLAGS, f"--data_dir={folder}", f"--model_dir={run}"]),
                          "has no test/ folder")
    assert not run.exists()
    assert_ok(train([*FLAGS, f"--data_dir={folder}", "--test_fraction=0.25", "--noexport",
                     f"--model_dir={run}"]))
    assert read_summary(run)["eval_examples"] == 3 * 6, "a quarter of each class's 24"


def test_hard_links_to_one_image_in_one_class_train_as_copies(tmp_path):
    """What deduplicating tools (hardlink(1), rdfind, jdupes -L) make of two
    copies of an image: links to one file. In one class they train as the
    copies did; refused, the run named the class folder twice (review). In
    two classes they are one image of both, refused naming the two files."""
    folder = write_folder(tmp_path / "photos")
    os.unlink(folder / "train" / "dogs" / "001.png")
    os.link(folder / "train" / "dogs" / "000.png", folder / "train" / "dogs" / "001.png")
    assert_ok(train([*FLAGS, f"--data_dir={folder}", "--noexport", f"--model_dir={tmp_path / 'run'}"]))
    os.link(folder / "train" / "dogs" / "002.png", folder / "train" / "ships" / "extra.png")
    assert_one_error_line(train([*FLAGS, f"--data_dir={folder}", f"--model_dir={tmp_path / 'other'}"]),
                          f"photos/train/dogs/002.png and {folder / 'train' / 'ships' / 'extra.png'} "
                          f"are one (a link, or hard links)")
    # Held out of one class, the links of an image may fall on both sides: checked as drawn.
    held = write_folder(tmp_path / "held", test=False)
    for i in range(12):
        os.link(held / "train" / "dogs" / f"{i:03d}.png", held / "train" / "dogs" / f"copy{i}.png")
    assert_one_error_line(train([*FLAGS, f"--data_dir={held}", "--test_fraction=0.25",
                                 f"--model_dir={tmp_path / 'held_run'}"]), "are one (a link")


def _damaged(root):
    path = root / "train" / "dogs" / "007.png"
    path.write_bytes(path.read_bytes()[:60])
    return "007.png begins as a PNG image does but does not decode"


def _not_an_image(root):
    (root / "train" / "cars" / "notes.txt").write_text("taken in May\n")
    return "notes.txt is not an image file"


def _unknown_class(root):
    (root / "test" / "cats").mkdir()
    return "test has class folder(s) cats that"


def _class_not_utf_8(root):
    # A Latin-1 file name, as an old archive leaves it: it trained to the
    # end and then failed to be written into classes.txt, on every rerun.
    os.rename(root / "train" / "dogs", os.fsencode(root / "train") + b"/chiens-\xe9")
    shutil.rmtree(root / "test" / "dogs")
    return "is named in bytes that are not UTF-8"


def _class_with_a_newline(root):
    # It made two lines of classes.txt, and predict named the wrong classes.
    (root / "train" / "dogs").rename(root / "train" / "big\ndogs")
    shutil.rmtree(root / "test" / "dogs")
    return "has a control character (U+000A) in its name"


def _a_class_named_by_spaces_alone(root):
    # It trained, and predict answered with a class that read as nothing.
    (root / "train" / "dogs").rename(root / "train" / " \u200b ")
    shutil.rmtree(root / "test" / "dogs")
    return "has no visible character in its name"


def _a_test_class_spelled_otherwise(root):
    # é as e and a combining accent (NFD, as macOS names files) in train/, as
    # one character in test/: "test has class folder(s) café that train does
    # not", the two names printed alike.
    for split, name in (("train", "cafe\u0301s"), ("test", "caf\u00e9s")):
        (root / split / "dogs").rename(root / split / name)
    return ("photos/train/cafe\u0301s read as one name but are spelled differently (in case, "
            "Unicode form")


def _a_test_class_spelled_both_ways(root):
    # test/ holds the class as train/ spells it and spelled otherwise: it
    # said "rename the one in test/", onto the folder already there.
    import shutil
    shutil.copytree(root / "test" / "dogs", root / "test" / "Dogs")
    return "photos/train/dogs read as one name but are spelled differently (in case, " \
        "Unicode form, invisible characters or spaces at their ends): merge it into the one " \
        "spelled as in train/"


def _one_class(root):
    # All 24 images in one class: it trained, and learned that everything is a car.
    for split in ("train", "test"):
        for name in ("dogs", "ships"):
            for image in (root / split / name).iterdir():
                image.rename(root / split / "cars" / f"{name}-{image.name}")
            (root / split / name).rmdir()
    return "holds one class folder (cars): a classifier needs two classes or more"


def _a_link_to_nothing(root):
    (root / "train" / "dogs" / "lost.png").symlink_to(root / "nowhere.png")
    return "lost.png is a symbolic link to nothing, not a regular file"


def _a_link_that_loops(root):
    link = root / "train" / "dogs" / "loop.png"
    link.symlink_to(link)
    return "loop.png is a symbolic link in a loop, not a regular file"


def _a_class_link_that_loops(root):
    # Skipped with a warning, the run trained without the class it may have been.
    (root / "train" / "birds").symlink_to("birds")
    return "train/birds is a symbolic link in a loop, among the class folders: point it at"


def _a_class_link_to_nothing(root):
    (root / "test" / "birds").symlink_to(root / "unmounted" / "birds")
    return "test/birds is a symbolic link to nothing, among the class folders"


def _a_folder_in_a_class_folder(root):
    # Read by Keras and torchvision; here it was "is a directory, not a
    # regular file: give an image file", which said nothing of what to do.
    (root / "train" / "dogs" / "puppies").mkdir()
    (root / "train" / "dogs" / "000.png").rename(root / "train" / "dogs" / "puppies" / "0.png")
    return "train/dogs/puppies is a folder in class folder"


def _a_test_file(root):
    # "has no test/ folder: add one", where the user saw one.
    shutil.rmtree(root / "test")
    (root / "test").write_text("cars 0.png\n")
    return "photos/test is a file, not a folder: an image folder is laid out as"


def _an_empty_test_folder(root):
    # Its class folders are there, and may each be empty; all of them may
    # not: the run trained to the end and failed to evaluate 0 images.
    for image in (root / "test").glob("*/*"):
        image.unlink()
    return "test holds no images: put some of each class there"


def _a_test_folder_linked_to_train(root):
    # test/ made a link to train/: it trained, and scored 100% on the images it trained on.
    shutil.rmtree(root / "test")
    (root / "test").symlink_to("train")
    return "photos/train/cars and " + str(root / "test" / "cars") + " are one (a link"


def _a_class_linked_under_two_names(root):
    # ships/ a link to dogs/: every dog trained as a dog and as a ship.
    for split in ("train", "test"):
        shutil.rmtree(root / split / "ships")
        (root / split / "ships").symlink_to("dogs")
    return "photos/train/dogs and " + str(root / "train" / "ships") + " are one (a link"


def _a_training_image_hard_linked_into_test(root):
    # Scored as unseen: the test accuracy counted an image the model trained on.
    (root / "test" / "dogs" / "000.png").unlink()
    os.link(root / "train" / "dogs" / "003.png", root / "test" / "dogs" / "000.png")
    return "train/dogs/003.png and " + str(root / "test" / "dogs" / "000.png") + " are one"


def _classes_that_read_as_one(root):
    # Two classes that a person reads as one, each with part of its images.
    for split in ("train", "test"):
        (root / split / "dogs").rename(root / split / "ＣＡＲＳ")  # full-width letters
    return "train/cars and ＣＡＲＳ read as one name (they differ only in case, Unicode form"


def _classes_apart_by_an_invisible_character(root):
    # A zero-width space: printed raw, the two names looked the same.
    for split in ("train", "test"):
        (root / split / "dogs").rename(root / split / "car\u200bs")
    return "train/cars and car\\u200bs read as one name"


@pytest.mark.parametrize("look_alike", ["cat\ufe0f", "cat\u034f", "cat\u3164", "cat ", " Cat",
                                        "c\u00adat", "\uff43at"])
def test_class_names_that_print_as_one_read_as_one(look_alike):
    """A variation selector, a combining grapheme joiner, a Hangul filler, a
    soft hyphen (drawn as nothing), spaces at an end, a full-width letter:
    each made a second class that predict printed as the first."""
    assert dataset.read_as(look_alike) == dataset.read_as("cat")
    assert "read as one" in dataset.class_names_problem(["cat", look_alike])
    assert dataset.class_names_problem(["cat", "cats", "\u0645\u06cc\u200c\u062e"]) is None


@pytest.mark.parametrize("spoil", [_damaged, _not_an_image, _unknown_class, _class_not_utf_8,
                                   _class_with_a_newline, _a_class_named_by_spaces_alone,
                                   _a_test_class_spelled_otherwise,
                                   _a_test_class_spelled_both_ways,
                                   _one_class, _a_link_to_nothing,
                                   _a_link_that_loops, _a_class_link_that_loops,
                                   _a_class_link_to_nothing, _a_folder_in_a_class_folder,
                                   _a_test_file,
                                   _an_empty_test_folder,
                                   _classes_that_read_as_one,
                                   _classes_apart_by_an_invisible_character,
                                   _a_test_folder_linked_to_train,
                                   _a_class_linked_under_two_names,
                                   _a_training_image_hard_linked_into_test])
def test_a_bad_folder_is_one_error_line_naming_it_before_training(tmp_path, spoil):
    folder = write_folder(tmp_path / "photos", train_per_class=8, test_per_class=2)
    fragment = spoil(folder)
    (folder / "train" / "cars" / ".DS_Store").write_bytes(b"\x00\x01")  # skipped: a dot file
    run = tmp_path / "run"
    assert_one_error_line(train([*FLAGS, f"--data_dir={folder}", f"--model_dir={run}"]), fragment)
    assert not run.exists(), "nothing written"


@pytest.mark.parametrize("make, said", [
    (lambda path: None, "does not exist"),
    (lambda path: path.write_bytes(b"x"), "is a file, not a folder")])
def test_a_data_dir_mistyped_or_a_file_is_named_so_not_as_without_train(tmp_path, make, said):
    """Both were "--data_dir=DIR has no train/ folder": the user looked
    for train/ in a folder that was not there."""
    data_dir, run = tmp_path / "photos", tmp_path / "run"
    make(data_dir)
    assert_one_error_line(train([*FLAGS, f"--data_dir={data_dir}", f"--model_dir={run}"]),
                          f"{data_dir} {said}")
    assert not run.exists(), "nothing written"


@pytest.mark.parametrize("model_dir, flags, split", [
    # A folder of the run's own among the classes: it trained once, and its
    # checkpoints/ was then a class that no resume could read.
    ("train", ["--adopt_model_dir"], "train"),
    # Refused as "train/run holds no images", a folder the user never made.
    ("train/run", [], "train"), ("train/cars/run", [], "train"),
    # Refused as "test has class folder(s) run that train does not".
    ("test/run", [], "test")])
def test_a_model_dir_among_the_classes_is_one_error_line(tmp_path, model_dir, flags, split):
    folder = write_folder(tmp_path / "photos", train_per_class=8, test_per_class=2)
    before = snapshot(folder)
    result = train([*FLAGS, f"--data_dir={folder}", f"--model_dir={folder / model_dir}", *flags])
    assert_one_error_line(result, f"--model_dir={folder / model_dir} is in --data_dir's {split}/ "
                                  f"({folder / split}), whose folders are read as classes")
    assert snapshot(folder) == before, "nothing written"


def test_more_classes_than_predict_takes_are_refused_before_any_image_is_read(tmp_path):
    """A folder of 100,001 classes (a face data set's identities) trained
    to the end, and predict then called the run's own export damaged ("it
    names 100,001 classes, where a classifier has 2 to 100,000") and said
    to train it again. Empty folders: the count is refused before they are read."""
    folder = tmp_path / "photos"
    for i in range(dataset.MAX_CLASSES + 1):
        (folder / "train" / f"{i:06d}").mkdir(parents=True)
    (folder / "test").mkdir()
    result = train([*FLAGS, f"--data_dir={folder}", f"--model_dir={tmp_path / 'run'}"])
    assert_one_error_line(result, f"{folder / 'train'} holds 100,001 class folders, more than "
                                  f"this program trains (100,000)")
    assert not (tmp_path / "run").exists(), "nothing written"


def test_test_fraction_beside_a_test_folder_is_an_error_not_ignored(tmp_path):
    folder = write_folder(tmp_path / "photos", train_per_class=8, test_per_class=2)
    run = tmp_path / "run"
    assert_one_error_line(train([*FLAGS, f"--data_dir={folder}", "--test_fraction=0.25",
                                 f"--model_dir={run}"]),
                          "--test_fraction=0.25 holds out training images for testing, and")
    assert not run.exists(), "nothing written"


# A run of a few steps, as small as a run gets: what is checked happens
# before and after training.
TINY = ["--dataset=image_folder", "--image_size=8", "--model=mlp", "--precision=float32",
        "--per_replica_batch_size=8", "--train_steps=2", "--steps_per_loop=2", "--noexport"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished run of 2 steps on a folder with entries it skips, and its
    config.json."""
    root = tmp_path_factory.mktemp("tiny")
    folder = write_folder(root / "photos", train_per_class=8, test_per_class=2)
    (folder / "train" / "..cats").mkdir()  # a dot name: skipped, as a Unix tool would
    Image.new("RGB", (8, 8)).save(folder / "train" / "..cats" / "0.png")
    (folder / "train" / "ships" / ".DS_Store").write_bytes(b"\x00")
    (folder / "train" / "labels.csv").write_text("file,label\n")
    # What Windows leaves beside photos, and macOS in a zip that another system
    # unpacks: each was refused as no image, __MACOSX taken for a class.
    (folder / "train" / "dogs" / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0" + bytes(60))
    (folder / "test" / "cars" / "desktop.ini").write_text("[.ShellClassInfo]\n")
    (folder / "train" / "__MACOSX" / "cars").mkdir(parents=True)
    (folder / "train" / "__MACOSX" / "cars" / "._000.png").write_bytes(b"\x00\x05\x16\x07")
    result = train([*TINY, f"--data_dir={folder}", f"--model_dir={root / 'run'}"])
    assert_ok(result)
    return folder, root / "run", result


def test_what_a_folder_skips_is_named_in_one_warning(tiny_run):
    _, _, result = tiny_run
    # A run this small also hears that its batch is above the batch rule's.
    warnings = [line for line in result.stderr.splitlines()
                if line.startswith("warning:") and "global batch" not in line]
    assert len(warnings) == 1, result.stderr
    assert ("skipped 6 entries of" in warnings[0] and "test/cars/desktop.ini, train/..cats, "
            "train/__MACOSX, train/dogs/Thumbs.db, train/labels.csv and 1 more" in warnings[0]
            ), warnings[0]


def test_the_run_records_its_data_and_that_image_folders_are_not_flipped(tiny_run):
    _, run, _ = tiny_run
    config = json.loads((run / "config.json").read_text())
    fingerprint = config["resolved"]["data_fingerprint"]
    assert fingerprint["classes"] == list(CLASSES) == config["resolved"]["dataset_info"][
        "class_names"]
    assert fingerprint["files"] == {"train": 24, "test": 6} and len(fingerprint["sha256"]) == 64
    assert config["augmentation"]["flip"] == "none", "a mirrored digit or letter is another sign"


def test_flips_are_the_dataset_s_default_unless_given(tmp_path):
    def flip(*flags):
        return train_entry_point.parse_config([*flags, f"--model_dir={tmp_path}"]).augmentation.flip

    folder = ["--dataset=image_folder", f"--data_dir={tmp_path}"]
    assert (flip(), flip("--dataset=synthetic"), flip(*folder)) == ("random", "random", "none")
    assert flip(*folder, "--flip=random") == "random"
    assert flip("--recipe=cpu_cnn", *folder) == "alternating", "a recipe's flags are given flags"


def _rename_a_class(folder):
    for split in ("train", "test"):
        (folder / split / "dogs").rename(folder / split / "hounds")
    return "class(es) dogs gone; class(es) hounds new"


def _add_a_class(folder):
    shutil.copytree(folder / "train" / "dogs", folder / "train" / "wolves")
    return "class(es) wolves new; train/ holds 32 files (was 24)"


def _remove_a_file(folder):
    (folder / "train" / "ships" / "003.png").unlink()
    return "train/ holds 23 files (was 24)"


def _rename_a_file(folder):
    (folder / "train" / "ships" / "003.png").rename(folder / "train" / "ships" / "100.png")
    return "the same classes and numbers of files, but other file names or sizes"


@pytest.mark.parametrize("change", [_rename_a_class, _add_a_class, _remove_a_file, _rename_a_file])
def test_a_resume_on_other_images_is_refused_naming_the_difference(tiny_run, tmp_path, change):
    folder, run, _ = tiny_run
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    fragment = change(other)
    # Under the run, not the run itself: the refused run proves it writable
    # (files.check_writable), which changes its time.
    before = snapshot(*run.iterdir(), directory_times=True)
    result = train([*TINY, "--train_steps=4", f"--data_dir={other}", f"--model_dir={run}"])
    assert_one_error_line(result, f"holds a run trained on other images than --data_dir={other} "
                                  f"holds: {fragment}")
    assert snapshot(*run.iterdir(), directory_times=True) == before, "nothing written"


def test_a_copy_of_the_images_elsewhere_and_a_run_without_a_fingerprint_resume(tiny_run, tmp_path):
    folder, run, _ = tiny_run
    copy, resumed = tmp_path / "copy", tmp_path / "run"
    shutil.copytree(folder, copy)
    shutil.copytree(run, resumed)
    # As recorded before the names' own digest was kept (in "sha256" too).
    config = json.loads((resumed / "config.json").read_text())
    del config["resolved"]["data_fingerprint"]["names_sha256"]
    (resumed / "config.json").write_text(json.dumps(config))
    assert_ok(train([*TINY, "--train_steps=4", f"--data_dir={copy}", f"--model_dir={resumed}"]))
    assert read_summary(resumed)["resumed_from_step"] == 2
    # A run from before fingerprints, and before image folders' flips were
    # off by default: its config.json has no fingerprint, and random flips.
    config = json.loads((resumed / "config.json").read_text())
    del config["resolved"]["data_fingerprint"]
    config["flip"] = "random"
    (resumed / "config.json").write_text(json.dumps(config))
    (copy / "train" / "ships" / "003.png").unlink()
    assert_one_error_line(train([*TINY, "--train_steps=6", f"--data_dir={copy}",
                                 f"--model_dir={resumed}"]), "Pass --flip=random")
    assert_ok(train([*TINY, "--train_steps=6", "--flip=random", f"--data_dir={copy}",
                     f"--model_dir={resumed}"]))
    assert read_summary(resumed)["resumed_from_step"] == 4


def test_a_dot_named_link_to_nothing_is_skipped_as_an_editor_s_lock(tmp_path, capsys):
    """Emacs locks a file it edits with a link to nothing named .#file."""
    from distributed_mpt.core.data import DataOptions
    from distributed_mpt.core.data.image_folder import load

    folder = write_folder(tmp_path / "photos", train_per_class=2, test_per_class=1)
    (folder / "train" / ".#notes.txt").symlink_to("user@host.4242:1700000000")
    dataset = load(DataOptions(dataset="image_folder", data_dir=str(folder), image_size=8), seed=0)
    assert dataset.info.class_names == CLASSES
    assert "skipped 1 entry" in capsys.readouterr().err


def test_a_nas_s_thumbnail_folders_are_skipped_not_a_class_nor_refused(tmp_path, capsys):
    """A Synology NAS makes @eaDir/ in every folder it indexes: it was a
    class of its own beside the class folders, and refused among the images."""
    from distributed_mpt.core.data import DataOptions

    folder = write_folder(tmp_path / "photos", train_per_class=2, test_per_class=1)
    for thumbnails in (folder / "train" / "@eaDir" / "cars", folder / "train" / "dogs" / "@eaDir"):
        thumbnails.mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(thumbnails / "SYNOPHOTO_THUMB_S.jpg")
    options = DataOptions(dataset="image_folder", data_dir=str(folder), image_size=8)
    assert options.load(seed=0).info.class_names == CLASSES
    assert "skipped 2 entries" in capsys.readouterr().err


def test_a_name_not_in_utf_8_reads_the_same_in_training_s_errors_and_predict_s_answers(
        tiny_run, tmp_path):
    """Its byte 0xE9 was \\xe9 in an image folder's error lines and \\udce9
    in predict's answers and the image decoder's errors (errors.quoted): one
    name, two spellings, for the user to match."""
    from distributed_mpt.predict import main as predict

    folder, run, _ = tiny_run
    named = os.fsencode(tmp_path) + b"/chiens-\xe9"
    shutil.copytree(folder / "train" / "dogs", os.fsdecode(named))
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    os.rename(other / "train" / "dogs", os.fsencode(other / "train") + b"/chiens-\xe9")
    shutil.rmtree(other / "test" / "dogs")
    assert_one_error_line(train([*TINY, f"--data_dir={other}", f"--model_dir={tmp_path / 'r'}"]),
                          f"class folder {other}/train/chiens-\\udce9 is named in bytes")
    photo = os.fsdecode(named + b"/000.png")
    result = run_in_process(predict, [f"--model_dir={run}", photo])
    assert_ok(result)
    assert result.stdout.startswith(f"{tmp_path}/chiens-\\udce9/000.png: "), result.stdout


def test_evaluating_on_classes_spelled_otherwise_says_so(tiny_run, tmp_path):
    """predict --evaluate on a copy whose class is Cars, of a model of cars:
    "has the classes Cars, dogs, ships, and the model predicts cars, dogs,
    ships", which a name in NFD and one in NFC print alike."""
    from distributed_mpt.predict import main as predict

    folder, run, _ = tiny_run
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    for split in ("train", "test"):
        (other / split / "cars").rename(other / split / "Cars")
    assert_one_error_line(run_in_process(predict, [f"--model_dir={run}", "--evaluate",
                                                   f"--data_dir={other}"]),
                          "has the classes Cars, dogs, ships (spelled otherwise: in case, "
                          "Unicode form")


def _deep_folder(tmp_path, length: int):
    """A folder whose path is about `length` bytes, in names of 200."""
    deep = tmp_path
    while len(os.fsencode(deep)) < length - 201:
        deep = deep / ("d" * 200)
    deep.mkdir(parents=True)
    return deep


def test_a_class_folder_whose_path_is_too_long_to_open_is_named_so(tmp_path):
    """It was "holds no images": the folder holds one, and the system
    refused its path of more than PATH_MAX bytes (ENAMETOOLONG)."""
    folder = write_folder(_deep_folder(tmp_path, 3900) / "photos", train_per_class=2,
                          test_per_class=1)
    train_fd = os.open(folder / "train", os.O_RDONLY | os.O_DIRECTORY)
    try:  # reached through its parent's descriptor: the whole path cannot be opened
        os.mkdir("long-" + "x" * 240, dir_fd=train_fd)
        class_fd = os.open("long-" + "x" * 240, os.O_RDONLY | os.O_DIRECTORY, dir_fd=train_fd)
        os.close(os.open("0.png", os.O_WRONLY | os.O_CREAT, dir_fd=class_fd))
        os.close(class_fd)
    finally:
        os.close(train_fd)
    length = len(os.fsencode(folder / "train")) + 246
    assert length > os.pathconf("/", "PC_PATH_MAX")
    result = train([*TINY, f"--data_dir={folder}", f"--model_dir={tmp_path / 'run'}"])
    assert_one_error_line(result, f"xxxxxxxxxx (a path of {length:,} bytes, where this system "
                                  f"opens fewer than {os.pathconf('/', 'PC_PATH_MAX'):,}): move "
                                  f"--data_dir to a shorter path")
    assert f"{str(tmp_path)[:40]}" in result.stderr, "its start is named too"


def test_a_class_without_test_images_is_named_in_a_warning(tmp_path):
    """An empty test/<class> (or none) left the class out of the test
    accuracy without a word."""
    folder = write_folder(tmp_path / "photos", train_per_class=8, test_per_class=2)
    for image in (folder / "test" / "dogs").iterdir():
        image.unlink()
    shutil.rmtree(folder / "test" / "ships")
    result = train([*TINY, f"--data_dir={folder}", f"--model_dir={tmp_path / 'run'}"])
    assert_ok(result)
    warnings = [line for line in result.stderr.splitlines() if "test images of each" in line]
    assert warnings == [f"warning: {folder / 'test'} holds no images of 2 of the 3 classes "
                        f"(dogs, ships): the test accuracy says nothing of them; put test images "
                        f"of each class in its folder there"], result.stderr
    assert read_summary(tmp_path / "run")["eval_examples"] == 2


def test_a_held_out_split_of_a_folder_changed_since_training_is_refused(tmp_path):
    """--test_fraction's split is drawn from the folder's list of files: with
    an image added to each class, predict drew it again from another list, and
    1 of its 6 "held-out" images was one the model trained on, unsaid."""
    from distributed_mpt.predict import main

    folder = write_folder(tmp_path / "photos", train_per_class=8, test=False)
    run = tmp_path / "run"
    flags = [*[f for f in TINY if f != "--noexport"], "--test_fraction=0.25",
             f"--data_dir={folder}", f"--model_dir={run}"]
    assert_ok(train(flags))
    export = run / "export"
    info = (export / "model_info.json").read_text()
    recorded = json.loads((run / "config.json").read_text())["resolved"]["data_fingerprint"]
    assert json.loads(info)["data_fingerprint"] == recorded
    # A run directory recorded before the held-out pixels were (its record lacks them) resumes.
    old_run = tmp_path / "old_run"
    shutil.copytree(run, old_run)
    config = json.loads((old_run / "config.json").read_text())
    del config["resolved"]["data_fingerprint"]["held_out_pixels_sha256"]
    (old_run / "config.json").write_text(json.dumps(config))
    assert_ok(train([*flags, f"--model_dir={old_run}", "--train_steps=4"]))
    assert read_summary(old_run)["resumed_from_step"] == 2
    shutil.rmtree(export / "saved_model")  # exported again by the finished run: the same record
    assert_ok(train(flags))
    assert (export / "model_info.json").read_text() == info
    evaluate = [f"--model_dir={run}", "--evaluate", f"--data_dir={folder}"]
    evaluated = run_in_process(main, evaluate)
    assert_ok(evaluated)
    assert "(6 images)" in evaluated.stdout and "warning" not in evaluated.stderr
    # Re-encoded in place (other sizes, as an optimizer of PNGs leaves them): the same
    # names draw the same split, which the model never saw; it was refused as another folder.
    for path in sorted((folder / "train").glob("*/*.png")):
        Image.open(path).save(path, compress_level=0)
    reencoded = run_in_process(main, evaluate)
    assert_ok(reencoded)
    assert reencoded.stdout == evaluated.stdout and "warning" not in reencoded.stderr
    # The same names holding other photos (a download numbered otherwise): the held-out
    # names now hold photos the model trained on. It was accepted, scored as unseen.
    _rotate_each_class(folder, 1)
    assert_one_error_line(run_in_process(main, evaluate), (
        f"--data_dir={folder} is not the folder the model trained on, or has changed since (the "
        f"same classes and file names, but other images in its held-out test split"))
    _rotate_each_class(folder, -1)
    assert run_in_process(main, evaluate).stdout == evaluated.stdout
    # An export from before the pixels were recorded: its names and sizes must be the same.
    record = json.loads((export / "model_info.json").read_text())
    del record["data_fingerprint"]["held_out_pixels_sha256"]
    (export / "model_info.json").write_text(json.dumps(record))
    assert_one_error_line(run_in_process(main, evaluate), (
        f"--data_dir={folder} is not the folder the model trained on, or has changed since (the "
        f"same classes and numbers of files, but other file names or sizes"))
    (export / "model_info.json").write_text(info)
    for name in CLASSES:  # one more photo of each class, as a user adds them
        _photo(folder / "train" / name / "100.png", COLOURS[name], np.random.default_rng(1))
    said = (f"--data_dir={folder} is not the folder the model trained on, or has changed since "
            f"(train/ holds 27 "
            f"files (was 24)): the test split held out of it (--test_fraction) would mix in")
    assert_one_error_line(run_in_process(main, evaluate), said)
    export.rename(tmp_path / "export")  # a run's checkpoint: its config.json says the same
    assert_one_error_line(run_in_process(main, evaluate), said)
    (tmp_path / "export").rename(export)
    # The remedy said: a test/ folder of images it never saw is evaluated.
    write_folder(tmp_path / "new", train_per_class=1, test_per_class=2)
    shutil.copytree(tmp_path / "new" / "test", folder / "test")
    on_test = run_in_process(main, evaluate)
    assert_ok(on_test)
    assert "(6 images)" in on_test.stdout and "warning" not in on_test.stderr
    # An export from before model_info.json recorded the fingerprint, of the folder as it is
    # now: what it cannot tell is said, and it evaluates.
    shutil.rmtree(folder / "test")
    info = json.loads((export / "model_info.json").read_text())
    del info["data_fingerprint"]
    (export / "model_info.json").write_text(json.dumps(info))
    unknown = run_in_process(main, evaluate)
    assert_ok(unknown)
    warnings = [line for line in unknown.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "cannot tell whether" in warnings[0], unknown.stderr
    assert "(6 images)" in unknown.stdout


def test_a_resume_on_photos_moved_among_the_same_names_is_refused(tmp_path):
    """BMPs of one size are all the same number of bytes: photos moved among the
    same names kept the names and sizes a resume compared, so it resumed, and its
    export recorded the new held-out split, photos the model had trained on, which
    predict --evaluate then scored as unseen (accuracy 1.0)."""
    folder = write_folder(tmp_path / "photos", train_per_class=8, test=False, extension="bmp")
    run = tmp_path / "run"
    flags = [*TINY, "--test_fraction=0.25", f"--data_dir={folder}", f"--model_dir={run}"]
    assert_ok(train(flags))
    _rotate_each_class(folder, 1, "bmp")
    before = snapshot(*run.iterdir(), directory_times=True)
    assert_one_error_line(train([*flags, "--train_steps=4"]), (
        f"holds a run trained on other images than --data_dir={folder} holds: the same classes "
        f"and file names, but other images in its held-out test split"))
    assert snapshot(*run.iterdir(), directory_times=True) == before, "nothing written"
    # The flags that draw the split change its pixels too: refused as they are, not as other
    # images (another --image_size makes an MLP of other shapes).
    for changed, said in (("--image_size=16", "holds checkpoints of a different model"),
                          ("--test_fraction=0.5", "--test_fraction=0.25 to 0.5")):
        assert_one_error_line(train([*flags, "--train_steps=4", changed]), said)
    assert snapshot(*run.iterdir(), directory_times=True) == before, "nothing written"
    _rotate_each_class(folder, -1, "bmp")
    assert_ok(train([*flags, "--train_steps=4"]))
    assert read_summary(run)["resumed_from_step"] == 2


def _rotate_each_class(folder, places, extension="png"):
    """Moves each class's photos `places` names on among its files (the last's to the first)."""
    for name in CLASSES:
        paths = sorted((folder / "train" / name).glob(f"*.{extension}"))
        photos = [path.read_bytes() for path in paths]
        for path, photo in zip(paths, photos[-places:] + photos[:-places]):
            path.write_bytes(photo)


def test_test_images_that_are_copies_of_training_images_are_warned_of(tmp_path):
    """A byte-for-byte copy of a training image in test/ (not a link: cp, a
    download unpacked twice) was scored as unseen, unsaid."""
    folder = write_folder(tmp_path / "photos", train_per_class=8, test_per_class=2)
    shutil.copy(folder / "train" / "cars" / "003.png", folder / "test" / "cars" / "copy.png")
    shutil.copy(folder / "train" / "dogs" / "005.png", folder / "test" / "ships" / "x.png")
    result = train([*TINY, f"--data_dir={folder}", f"--model_dir={tmp_path / 'run'}"])
    assert_ok(result)
    warnings = [line for line in result.stderr.splitlines()
                if line.startswith("warning:") and "global batch" not in line]
    test, trained = folder / "test", folder / "train"
    assert warnings == [
        f"warning: 2 of the 8 test images are byte-for-byte copies of training images "
        f"({test / 'cars' / 'copy.png'} of {trained / 'cars' / '003.png'}, "
        f"{test / 'ships' / 'x.png'} of {trained / 'dogs' / '005.png'}): the test accuracy "
        f"counts them as unseen; remove them from test/"], result.stderr


def test_greyscale_photos_train_airbench_in_bfloat16_to_a_finite_loss(tmp_path):
    """Greyscale files read as three equal channels: 8 of the 12 directions
    of airbench's 2x2 patches do not vary, and their whitening filters gave
    constant channels (exact zeros in bfloat16) that batch norm after batch
    norm amplified; one step made the evaluation NaN and the export a
    traceback."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 10), ("test", 4)):
        for label, shade in enumerate((60, 190)):
            (folder := tmp_path / "photos" / split / str(label)).mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(shade + rng.integers(-60, 60, (8, 8)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels, "L").save(folder / f"{i}.png")
    run = tmp_path / "run"
    result = train(["--model=airbench", "--dataset=image_folder", "--image_size=16",
                    "--precision=mixed_bfloat16", "--train_steps=1", "--per_replica_batch_size=4",
                    f"--data_dir={tmp_path / 'photos'}", f"--model_dir={run}"])
    assert_ok(result)
    assert np.isfinite(read_summary(run)["eval_loss"])
    assert (run / "export" / "model_info.json").exists()
