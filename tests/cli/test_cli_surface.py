"""The command line's own surface: version, help with defaults, flags after the
subcommand, missing paths, machine-readable listings. In process, no Ray."""

from __future__ import annotations

import json

import pytest

from planaria._version import __version__
from planaria.cli.main import main


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"planaria {__version__}"


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "committed (default: 70)" in text and "keeps) (default: 3)" in text


@pytest.mark.parametrize("argv", [["ckpt", "ls", "{missing}"],
                                  ["ckpt", "verify", "{missing}"],
                                  ["ckpt", "export", "{missing}", "--out", "{out}"]])
def test_a_missing_path_is_one_line_and_exit_2(tmp_path, capsys, argv):
    argv = [a.format(missing=tmp_path / "nope", out=tmp_path / "w.safetensors") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and str(tmp_path / "nope") in err[0]
    assert not (tmp_path / "w.safetensors").exists()


def test_ckpt_ls_as_json_and_verbose_after_the_subcommand(tmp_path, capsys):
    import torch

    from planaria.checkpoint import AsyncShardWriter, plan_shards
    from planaria.checkpoint.commit import commit_checkpoint

    root = tmp_path / "checkpoints"
    tensors = {"model/w": torch.arange(6.0)}
    (plan,) = plan_shards({n: (t.shape, t.dtype) for n, t in tensors.items()}, 1)
    writer = AsyncShardWriter(str(root))
    writer.start(3, tensors, plan)
    commit_checkpoint(str(root), 3, [writer.result()], {}, world_size=1)
    writer.close()
    assert main(["ckpt", "ls", "-v", str(tmp_path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["step"], row["committed"], row["verified"]) == (3, True, True)
