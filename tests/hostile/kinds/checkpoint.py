"""Broken checkpoints a user meets: a rank file missing, left over, truncated, empty or garbage; files
from different saves; `latest` pointing nowhere; a pickle that tries to run code. The first corpus,
moved here from tests/test_validate.py with the messages it pinned."""

from __future__ import annotations

import math
import os
import shutil
import zipfile

from tests.hostile.corpus import CHECKPOINT_READERS, DEEP, VALIDATE, Workspace, kind
from tests.hostile.torchfile import Payload, load, resave

Z2 = "z2-bf16-ws2"


@kind(expect=r"rank-missing|rank 1 of 2 is missing")
def missing_rank_file(ws: Workspace) -> None:
    """An optimizer file of rank 1 is missing (an upload still in progress)."""
    name = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    ws.remove(f"{ws.tag}/{name}")
    ws.pin(f"rank 1 of 2 is missing: expected {ws.tag}/{name} under {ws.src}; the upload may still be in progress, "
            "or the checkpoint was saved with fewer ranks")


@kind(source=Z2, expect=r"rank 2 is beyond the world size 2")
def extra_rank_file(ws: Workspace) -> None:
    """A rank file beyond the world size, left over from another save into the same folder."""
    shutil.copy(ws.optim_file(1), ws.tag_dir / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    ws.pin("bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    ws.pin("rank-extra", VALIDATE, DEEP)


@kind(expect=r"is not a readable torch archive.*copy it again")
def truncated_file(ws: Workspace) -> None:
    """Rank 0's optimizer file cut in half."""
    path = ws.optim_file(0)
    ws.write(path.relative_to(ws.src), path.read_bytes()[: path.stat().st_size // 2])
    ws.pin(str(path))
    ws.pin("corrupt-file", VALIDATE, DEEP)


@kind(expect=r"is empty \(0 bytes\)")
def zero_byte_file(ws: Workspace) -> None:
    """Rank 1's model states file is empty."""
    path = ws.write(ws.model_file(1).relative_to(ws.src), b"")
    ws.pin(f"rank 1: {path} is empty (0 bytes)")


@kind(source=Z2, expect=r"is not a readable torch archive")
def garbage_file(ws: Workspace) -> None:
    """Rank 1's optimizer file is 4 KB of random bytes."""
    path = ws.optim_file(1)
    ws.write(path.relative_to(ws.src), ws.param(os.urandom(4096), lambda r: r.randbytes(r.randrange(1, 1 << 16))))
    ws.pin(f"rank 1: {path} is not a readable torch archive")


@kind(expect=r"does not exist")
def latest_names_missing_tag(ws: Workspace) -> None:
    """`latest` names a tag that was never saved."""
    ws.write("latest", "global_step999")
    ws.pin(f"tag folder {ws.src}/global_step999 does not exist")


def _path_trick(tag: str):  # noqa: ANN202
    def build(ws: Workspace) -> None:
        ws.write("latest", tag)
        ws.pin("latest-unsafe", VALIDATE, DEEP)
    build.__doc__ = f"`latest` holds the path {tag!r}, not a folder name."
    return build


for _name, _tag in (("dotdot", "../../etc"), ("inner-dotdot", "global_step1/../x"), ("absolute", "/etc/passwd"),
                    ("slash", "a/b")):
    kind(name=f"latest-path-{_name}", expect=r"not a plain folder name")(_path_trick(_tag))


@kind(expect=r"no `latest` file in")
def missing_latest(ws: Workspace) -> None:
    """No `latest` in the folder given."""
    ws.remove("latest")
    ws.pin(f"no `latest` file in {ws.src}")


@kind(code=0)
def tag_folder_without_latest(ws: Workspace) -> None:
    """A tag folder itself is accepted without `latest` (not hostile: the case above's other half)."""
    ws.remove("latest")
    ws.src_arg = str(ws.tag_dir)


@kind(expect=r"rank 1 records global step")
def ranks_from_different_steps(ws: Workspace) -> None:
    """Rank 1's model states come from a later save."""
    bump = ws.param(5, lambda r: r.choice([1, 5, -3, 10**12]))
    resave(ws.model_file(1), lambda o: o.__setitem__("global_steps", o["global_steps"] + bump))
    ws.pin("ranks-disagree", VALIDATE, DEEP)


@kind(source=Z2, expect=r"rank 1's optimizer.*mixes files from different saves")
def optimizer_steps_differ_between_ranks(ws: Workspace) -> None:
    """Rank 1's optimizer is 3 steps ahead of rank 0's: weights from two saves (consolidate checks it
    too, through the reader: issue 14, new)."""
    def bump(o: dict) -> None:
        for state in o["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
            state["step"] = state["step"] + 3  # an int or a tensor, depending on the optimizer

    resave(ws.optim_file(1), bump)


@kind(source=Z2, expect=r"world-size-mismatch|was saved with 3 partitions but")
def mismatched_world_size_in_metadata(ws: Workspace) -> None:
    """Rank 0's optimizer says it was partitioned 3 ways in a 2-rank checkpoint."""
    def grow(o: dict) -> None:
        count = o["optimizer_state_dict"]["partition_count"]
        o["optimizer_state_dict"]["partition_count"] = [c + 1 for c in count] if isinstance(count, list) else count + 1

    resave(ws.optim_file(0), grow)
    ws.pin("was saved with 3 partitions but")


@kind(expect=r"its parameters need")
def partition_sizes_that_do_not_add_up(ws: Workspace) -> None:
    """Rank 1's flat fp32 partition and moments are one element short."""
    def trim(o: dict) -> None:
        osd = o["optimizer_state_dict"]
        osd["fp32_flat_groups"][0] = osd["fp32_flat_groups"][0][:-1].clone()
        for key in ("exp_avg", "exp_avg_sq"):
            osd["optimizer_state_dict"]["state"][0][key] = osd["optimizer_state_dict"]["state"][0][key][:-1].clone()

    resave(ws.optim_file(1), trim)
    ws.pin("partition-mismatch", VALIDATE, DEEP)


@kind(commands=(VALIDATE, DEEP), expect=r"non-finite.*hold 1 NaN/Inf value\(s\)", overrides={VALIDATE: {"code": 0}})
def nan_in_weights(ws: Workspace) -> None:
    """One NaN in rank 0's fp32 master weights: cheap validation passes, `--deep` finds it."""
    import torch

    def poison(o: dict) -> None:
        with torch.no_grad():
            o["optimizer_state_dict"]["fp32_flat_groups"][0][1] = math.nan

    resave(ws.optim_file(0), poison)


@kind(expect=r"refers to posix\.system, which ckptflow does not load")
def pickle_that_tries_to_run_code(ws: Workspace) -> None:
    """Rank 1's model states carry an object whose unpickling would run `touch MARKER`."""
    path = ws.model_file(1)
    obj = load(path)
    obj["payload"] = Payload(os.system, f"touch {ws.marker}")
    import torch

    torch.save(obj, path)
    ws.pin(f"{path} refers to posix.system, which ckptflow does not load")
    ws.pin("unsafe-pickle", VALIDATE, DEEP)


@kind(expect=r"is a zip file but not a torch archive")
def zip_that_is_not_a_torch_archive(ws: Workspace) -> None:
    """Rank 0's model states replaced by an ordinary zip file."""
    path = ws.remove(ws.model_file(0).relative_to(ws.src))
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("hello.txt", "hi")


@kind(code=2, expect=r"not a plain folder name", commands=CHECKPOINT_READERS)
def unsafe_tag_argument(ws: Workspace) -> None:
    """`--tag ../x` on the command line: a usage error."""
    for command in CHECKPOINT_READERS:
        ws.extra_args[command] = ["--tag", "../x"]
