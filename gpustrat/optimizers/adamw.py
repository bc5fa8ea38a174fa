"""AdamW: Adam with decoupled weight decay (Loshchilov and Hutter), as Keras writes it."""

from __future__ import annotations

from gpustrat.optimizers.adam import Adam


class AdamW(Adam):
    """``keras.optimizers.AdamW``: Adam whose weight decay is on by default: each step
    first decays the weights, ``w -= w * weight_decay * lr``, then takes the Adam step.

    Args:
        weight_decay: the decay rate (default 0.004, as Keras; not None).
        exclude_from_weight_decay: regular expressions (``re`` syntax); a variable
            whose name any of them matches somewhere (``re.search``, as Keras) is not
            decayed: ``["bias"]`` excludes every name containing "bias", ``["bias$"]``
            only names ending in it.
        Other arguments as :class:`Adam`.
    """

    def __init__(self, learning_rate=0.001, weight_decay: float = 0.004, beta_1=0.9,
                 beta_2=0.999, epsilon=1e-7, amsgrad=False, name: str = "AdamW",
                 compression=None, exclude_from_weight_decay=None, **common):
        if weight_decay is None:
            raise ValueError("AdamW's weight_decay must be a non-negative number, got "
                             "None; use Adam for no decay")
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad, name, compression,
                         weight_decay=weight_decay,
                         exclude_from_weight_decay=exclude_from_weight_decay, **common)
