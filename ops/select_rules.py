"""The names of the channel-sparse selection's rules, torch-free so that the CLI's flags and the settings read
them without loading torch."""

CHANNEL_RULES = ("paper", "max", "l2")  # how the r channels per KV head are chosen (ops/sparse_select.py)
COMBINE_RULES = ("sum", "lse", "psum")  # how a GQA group's query heads' scores become one per KV head
