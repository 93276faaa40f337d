"""Reading what earlier versions wrote: renamed config keys and earlier layouts of the train
state's leaves. Nothing else in the project needs to know that older runs exist.

    key = RENAMED.get(key, key)                        # config.py, on every config.json
    today = current_leaf(leaf, wanted)                 # checkpoint.py, on every stored leaf

A leaf is named by its key path as plain strings: ("opt_state", "0", "inner_state", "1", "mu",
"embed"). Three layouts of the optimizer state have been written:

    1 (before train.py was split): skip-step's state at the top, its inner chain ending in a
      count for the LR schedule;
    2: chain(skip_step(chain(...)), schedule): skip-step's state under "0", always present (off
      meant "non-finite rule only"), its metrics in its fields, and a state for the update
      clip even when it was off;
    3 (today, optim.py): refuse_nonfinite([skip_step](chain(...)), then=schedule), laid out
      as chain's tuple: the always-on non-finite guard under "0", skip-step only when it is
      on, and each piece's metrics in a `metrics` NamedTuple.
"""

# config.json keys written by an earlier version, and what they are called now.
RENAMED = {"data.skip_steps": "data.replace_batches",
           "max_consecutive_skips": "max_consecutive_nonfinite"}

_SKIP_FIELDS = {"loss_history": "loss_history", "grad_norm_history": "grad_norm_history",
                "count": "count", "skipped_in_a_row": "outliers_in_a_row"}


def _layout_1_to_2(leaf: tuple[str, ...]) -> tuple[str, ...] | None:
    """The schedule's count is dropped (the global step drives the schedule now); the rest
    moves under chain element 0."""
    if leaf[:1] != ("opt_state",) or leaf[1] in ("0", "1"):
        return leaf
    return None if leaf == ("opt_state", "inner_state", "4", "count") else ("opt_state", "0",
                                                                           *leaf[1:])


def _layout_2_to_3(leaf: tuple[str, ...], skip_step: bool) -> tuple[str, ...] | None:
    """Skip-step's histories move inside the guard (dropped where skip-step is off); the inner
    chain moves inside skip-step, or stands where skip-step stood; metrics start over."""
    if leaf[:2] != ("opt_state", "0"):
        return leaf
    guard = ("opt_state", "0", "inner_state")
    chain = guard + ("inner_state",) * skip_step
    field, rest = leaf[2], leaf[3:]
    if field == "inner_state":
        return chain + rest
    if field in _SKIP_FIELDS and skip_step:
        return guard + (_SKIP_FIELDS[field],)
    return None  # skip-step's metrics; its histories where it is off


def is_layout_3(leaves) -> bool:
    return any(leaf[:3] == ("opt_state", "0", "metrics") for leaf in leaves)


def current_leaf(leaf: tuple[str, ...], wanted: set[tuple[str, ...]]) -> tuple[str, ...] | None:
    """Where a stored leaf of an earlier layout lives in today's state `wanted` (the target's
    leaf names); None: today's state has no place for it (a metric, a state that is gone)."""
    if leaf[:1] == ("opt_state",) and leaf[1:2] not in (("0",), ("1",)):
        leaf = _layout_1_to_2(leaf)
        if leaf is None:
            return None
    skip_step = ("opt_state", "0", "inner_state", "loss_history") in wanted
    today = _layout_2_to_3(leaf, skip_step)
    if today is not None and today[:1] == ("opt_state",) and today not in wanted:
        return None  # e.g. the state of an update clip that was off
    return today


def starts_at_zero(leaf: tuple[str, ...]) -> bool:
    """Leaves that today's state has and earlier layouts did not: every metric (overwritten by
    the next step), and skip-step's count of outliers in a row (layout 1 had none)."""
    return "metrics" in leaf or leaf[-1] == "outliers_in_a_row"
