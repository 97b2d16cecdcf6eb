"""Rich markup and emoji codes in text that messages quote from the input: `[/` crashes the printer,
`[red]` silently disappears, `:x:` becomes an emoji. Whatever comes from input must be printed as it
is (the oracle checks the literal text is in the output)."""

from __future__ import annotations

import math

from tests.hostile.corpus import DEEP, PUSH, VALIDATE, Workspace, kind
from tests.hostile.torchfile import resave

MARKUPS = ["[/]", "[/red]", "[red]", "[bold blink]", ":x:", "[link=http://example.com]x[/link]", "\\[escaped]",
           "[red]:thumbs_up:[/red]", "[", "]"]


def _markup(ws: Workspace, canonical: str) -> str:
    return ws.param(canonical, lambda r: r.choice(MARKUPS))


@kind(expect=r"latest", issue="14.2")
def latest_closing_tag(ws: Workspace) -> None:
    """`latest` holds `[/]`: a closing tag with nothing to close."""
    text = _markup(ws, "[/]")
    ws.write("latest", text)
    ws.show(text)


@kind(expect=r"latest", issue="14.2")
def latest_style_tag(ws: Workspace) -> None:
    """`latest` holds `[red]global_step3`: the tag disappears from the message."""
    text = _markup(ws, "[red]") + "global_step3"
    ws.write("latest", text)
    ws.show(text)


@kind(expect=r"latest", issue="14.2")
def latest_emoji_code(ws: Workspace) -> None:
    """`latest` holds `:x:` (turned into an emoji)."""
    text = "global_step3" + _markup(ws, ":x:")
    ws.write("latest", text)
    ws.show(text)


@kind(expect=r"(?i)DeepSpeed version", issue="14.2")
def ds_version(ws: Workspace) -> None:
    """Rank 1 records the DeepSpeed version `0.19.8[/]`: ranks disagree, the message quotes it."""
    text = "0.19.8" + _markup(ws, "[/]")
    resave(ws.model_file(1), lambda o: o.__setitem__("ds_version", text))
    ws.show(text)


@kind(expect=r"frozen parameter", issue="14.2")
def frozen_parameter_name(ws: Workspace) -> None:
    """Rank 0 lists a frozen parameter named `[/]frozen.weight` that its fragments do not hold."""
    text = _markup(ws, "[/]") + "frozen.weight"

    def edit(o: dict) -> None:
        shapes = o["frozen_param_shapes"]
        shapes[text] = shapes.pop("frozen.weight")

    resave(ws.model_file(0), edit)
    ws.show(text)


@kind(commands=(VALIDATE, DEEP), expect=r"non-finite", issue="14.2", overrides={VALIDATE: {"code": 0}})
def tensor_name_in_deep_report(ws: Workspace) -> None:
    """A trainable parameter named `[red]emb.weight` (in every rank) holds a NaN: `--deep` names it."""
    import torch

    text = _markup(ws, "[red]") + "emb.weight"

    def rename(o: dict) -> None:
        for group in o["param_shapes"]:
            if "emb.weight" in group:
                items = [(text if k == "emb.weight" else k, v) for k, v in group.items()]
                group.clear()
                group.update(items)

    for rank in range(ws.world_size):
        resave(ws.model_file(rank), rename)

    def poison(o: dict) -> None:
        with torch.no_grad():
            o["optimizer_state_dict"]["fp32_flat_groups"][0][0] = math.nan

    resave(ws.optim_file(0), poison)
    ws.show(text, DEEP)


@kind(commands=(VALIDATE, DEEP), code=2, expect=r"--tag|plain folder|characters", issue="14.2")
def tag_argument(ws: Workspace) -> None:
    """`--tag '[red]x'` on the command line (a usage error that quotes it)."""
    text = _markup(ws, "[red]") + "x"
    for command in (VALIDATE, DEEP):
        ws.extra_args[command] = ["--tag", text]


@kind(source="model-folder", commands=(PUSH,), expect=r"not a ckptflow manifest", issue="14.2")
def manifest_format(ws: Workspace) -> None:
    """DEST holds a manifest whose `format` is `[/]`: the refusal quotes it."""
    text = _markup(ws, "[/]")
    import json

    ws.write_dest("ckptflow-manifest.json", json.dumps({"format": text, "version": 1, "files": []}))
    ws.show(text)
