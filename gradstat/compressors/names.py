"""The built-in compressors' names in the registry's order, readable without torch: the
command line's help lists them (tests/test_startup.py keeps them equal to the registry's)."""

BUILTIN = (
    "none",
    "fp16",
    "bf16",
    "topk",
    "randomk",
    "threshold",
    "dgc",
    "gaussiank",
    "redsync",
    "redsync-sidco",
    "sidco-exp",
    "sidco-gpd",
    "sidco-gamma-gpd",
    "clt-k",
    "gtopk",
    "powersgd",
    "signsgd",
    "ef-signsgd",
    "qsgd",
    "terngrad",
)
