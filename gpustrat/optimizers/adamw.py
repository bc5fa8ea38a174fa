"""AdamW: Adam with decoupled weight decay (Loshchilov and Hutter), as Keras writes it."""

from __future__ import annotations

from gpustrat.optimizers.adam import Adam


class AdamW(Adam):
    """``keras.optimizers.AdamW``: each step first decays the weights,
    ``w -= w * weight_decay * lr``, then takes the Adam step.

    Args:
        weight_decay: the decay rate (default 0.004, as Keras).
        exclude_from_weight_decay: variable names (or substrings of them) not decayed,
            e.g. ``["bias"]``.
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
        names = tuple(names or ())
        if self._decayed and names != self._exclude:
            # Which variables decay is settled by the first step (a fused step decays
            # every variable of its arena).
            raise ValueError(
                f"exclude_from_weight_decay {list(self._exclude)} -> {list(names)}: this "
                "AdamW has taken steps, and which variables decay is fixed by the first "
                "one; make the AdamW with the exclusions it should keep")
        self._exclude = names

    def _decays(self, name: str) -> bool:
        hit = self._decayed.get(name)
        if hit is None:
            hit = self._decayed[name] = not any(p in name
                                                for p in self.exclude_from_weight_decay)
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
