"""The first line of an exception: what a one-line error quotes of a library's many-line message."""

import pytest
import torch

from vitcli.checkpoints import pth
from vitcli.errors import CheckpointError, first_line


@pytest.mark.parametrize("error, line, named", [
    (RuntimeError("Error(s) in loading state_dict:\n\tMissing key(s)"), "Error(s) in loading state_dict:",
     "RuntimeError: Error(s) in loading state_dict:"),
    (OSError("\n  no such file  \nmore"), "no such file", "OSError: no such file"),  # blank lines skipped
    (EOFError(), "EOFError", "EOFError"),  # an empty message: the class name, never an IndexError
    (ValueError("   \n"), "ValueError", "ValueError"),
    (KeyError("model"), "'model'", "KeyError: 'model'"),
])
def test_first_line_is_the_first_line_that_says_something_else_the_class_name(error, line, named):
    assert first_line(error) == line
    assert first_line(error, named=True) == named


def test_a_torch_file_that_fails_with_an_empty_message_is_one_line_naming_it(tmp_path, monkeypatch):
    def truncated(*args, **kwargs):
        raise EOFError  # what torch.load raises on an empty file, without a word
    monkeypatch.setattr(torch, "load", truncated)
    path = tmp_path / "weights.pth"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"weights\.pth: not a readable torch\.save file \(EOFError\)"):
        pth._load(path, is_zip=False)
