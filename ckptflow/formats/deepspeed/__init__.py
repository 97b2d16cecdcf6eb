"""DeepSpeed's checkpoint layouts: where each piece of a partitioned training state lives.

`names` (file names and the classes DeepSpeed pickles), `index` (tag resolution and the immutable
index of a data-parallel ZeRO 0/1/2/3 checkpoint), `layout` (DeepSpeed's partition arithmetic, pure
functions over integers). Readers of the tensor-, pipeline- and expert-parallel layouts live beside
them. Nothing here reads tensor bytes or knows about pipeline steps.
"""
