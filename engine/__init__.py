"""The machinery above core/: the loop (trainer), evaluation, optimizer and schedule, losses, precision, tracking,
and the checkpoint wing (engine/checkpoint/). Imports core/ only; never data/ or models/.
"""
