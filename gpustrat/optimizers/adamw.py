"""AdamW: Adam with decoupled weight decay (Loshchilov and Hutter), as Keras writes it."""

from __future__ import annotations

import re

from gpustrat.optimizers.adam import Adam


class AdamW(Adam):
    """``keras.optimizers.AdamW``: each step first decays the weights,
    ``w -= w * weight_decay * lr``, then takes the Adam step.

    Args:
        weight_decay: the decay rate (default 0.004, as Keras).
        exclude_from_weight_decay: regular expressions (``re`` syntax); a variable
            whose name any of them matches somewhere (``re.search``, as Keras) is not
            decayed: ``["bias"]`` excludes every name containing "bias", ``["bias$"]``
            only names ending in it.
        Other arguments as :class:`Adam`.
    """

    agreed_settings = Adam.agreed_settings + ("weight_decay", "exclude_from_weight_decay")

    def __init__(self, learning_rate=0.001, weight_decay: float = 0.004, beta_1=0.9,
                 beta_2=0.999, epsilon=1e-7, amsgrad=False, name: str = "AdamW",
                 compression=None, exclude_from_weight_decay=None):
        if float(weight_decay) < 0:
            raise ValueError(f"weight_decay must be non-negative, got {weight_decay}")
        self.weight_decay = float(weight_decay)
        self._decayed: dict = {}
        self.exclude_from_weight_decay = exclude_from_weight_decay
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad, name, compression)

    @property
    def exclude_from_weight_decay(self) -> tuple:
        return self._exclude

    @exclude_from_weight_decay.setter
    def exclude_from_weight_decay(self, names) -> None:
        if isinstance(names, str):
            names = (names,)
        names = tuple(names or ())
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"exclude_from_weight_decay takes regular expressions (strings) "
                            f"matched against variable names, got {bad!r}")
        try:
            # Keras joins the patterns into one alternation and searches each name.
            pattern = re.compile("|".join(names)) if names else None
        except re.error as e:
            raise ValueError(f"exclude_from_weight_decay {list(names)}: not a regular "
                             f"expression ({e}); escape special characters with "
                             "re.escape to match them literally") from None
        if self._decayed and names != self._exclude:
            # Which variables decay is settled by the first step (a fused step decays
            # every variable of its arena).
            raise ValueError(
                f"exclude_from_weight_decay {list(self._exclude)} -> {list(names)}: this "
                "AdamW has taken steps, and which variables decay is fixed by the first "
                "one; make the AdamW with the exclusions it should keep")
        self._exclude = names
        self._exclude_pattern = pattern

    def _decays(self, name: str) -> bool:
        hit = self._decayed.get(name)
        if hit is None:
            pattern = self._exclude_pattern
            hit = self._decayed[name] = pattern is None or pattern.search(name) is None
        return hit

    def flat_ok(self, names) -> bool:
        # Variables excluded from the decay need their own update.
        return all(self._decays(n) for n in names)

    def update_step(self, param, grad, slots, lr, step, name):
        if self.weight_decay and (name is None or self._decays(name)):
            param -= param * (self.weight_decay * lr)
        super().update_step(param, grad, slots, lr, step, name)

    def get_config(self) -> dict:
        return {**super().get_config(), "weight_decay": self.weight_decay,
                "exclude_from_weight_decay": list(self.exclude_from_weight_decay)}
