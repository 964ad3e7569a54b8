"""A WebDataset tar cut short is found by its last kilobyte and named by a walk over its headers:
where it ends, and how many examples come whole before that."""

from __future__ import annotations

import tarfile

import pytest

from vitcli.data.rows import tar_shards
from vitcli.errors import DataError

EXAMPLES = 12


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """12 examples (KEY.jpg of 700 bytes + KEY.cls), as tar_shards.write_shard writes them."""
    path = tmp_path_factory.mktemp("tars") / "shard-00001.tar"
    examples = ((tar_shards.example_key(i), bytes([i + 1]) * 700, i % 3) for i in range(EXAMPLES))
    tar_shards.write_shard(path, examples, "jpg")
    return path


def _members(path):
    with tarfile.open(path) as tar:
        return tar.getmembers()


def _whole_before(path, size: int) -> int:
    """The examples all of whose members end inside the first `size` bytes, from tarfile's own
    offsets."""
    members = _members(path)
    keys = {m.name.split(".")[0] for m in members}
    return sum(all(m.offset_data + m.size <= size for m in members if m.name.split(".")[0] == key)
               for key in keys)


def _cut(whole, tmp_path, size: int):
    path = tmp_path / whole.name
    path.write_bytes(whole.read_bytes()[:size])
    return path


def test_a_whole_tar_is_whole_without_a_walk(whole, monkeypatch):
    monkeypatch.setattr(tar_shards, "walk", lambda path: pytest.fail("walked a whole tar"))
    assert tar_shards.ends_whole(whole) and tar_shards.cut_short(whole) is None


def test_a_tar_cut_inside_a_member_names_it_and_counts_the_whole_examples_before(whole, tmp_path):
    member = _members(whole)[2 * 5]  # example 5's image
    size = member.offset_data + member.size // 2
    walked = tar_shards.cut_short(_cut(whole, tmp_path, size))
    assert walked.cut == f"it ends inside member {member.name} at byte {member.size // 2}"
    assert walked.examples == _whole_before(whole, size) == 5


def test_a_tar_cut_inside_a_header_or_after_a_member_is_cut_short(whole, tmp_path):
    label = _members(whole)[2 * 7 + 1]  # example 7's label: its header starts a block before its data
    inside = tar_shards.cut_short(_cut(whole, tmp_path, label.offset + 100))
    assert inside.cut == "it ends inside the header after 00000007.jpg" and inside.examples == 7
    end = label.offset_data + tarfile.BLOCKSIZE  # example 7 whole, then nothing: no closing blocks
    after = tar_shards.cut_short(_cut(whole, tmp_path, end))
    assert after.cut == "it ends after 00000007.cls without the two zero blocks that close a tar"
    assert _whole_before(whole, end) == 8 and after.examples == 7  # the last one may have lost members


def test_a_tar_cut_inside_a_members_padding_is_cut_short(whole, tmp_path):
    image = _members(whole)[2 * 3]  # 700 bytes, padded to 1024
    walked = tar_shards.cut_short(_cut(whole, tmp_path, image.offset_data + image.size + 10))
    assert walked == tar_shards.Walked(3, "it ends inside the padding after 00000003.jpg")


def test_a_tar_cut_in_its_closing_zeros_holds_everything(whole, tmp_path):
    last = _members(whole)[-1]
    closed = last.offset_data + tarfile.BLOCKSIZE + 2 * tarfile.BLOCKSIZE + 100  # two zero blocks and more
    assert tar_shards.cut_short(_cut(whole, tmp_path, closed)) is None


def test_check_whole_names_the_shard_and_what_it_held(whole, tmp_path):
    member = _members(whole)[2 * 5]
    cut = _cut(whole, tmp_path, member.offset_data + 10)
    tar_shards.check_whole([str(whole)], "SRC")
    with pytest.raises(DataError) as e:
        tar_shards.check_whole([str(whole), str(cut)], "SRC")
    assert str(e.value) == (f"SRC: shard-00001.tar is cut short: 5 examples readable, then it ends inside "
                            f"member {member.name} at byte 10; copy or write the shard again")
    empty = _cut(whole, tmp_path, 0)
    with pytest.raises(DataError, match="shard-00001.tar is cut short: 0 examples readable, then it is not "
                                        "a readable tar"):
        tar_shards.check_whole([str(empty)], "SRC")
