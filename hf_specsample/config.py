"""Speculative-sampling options, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Draft tokens per round when the user gives none. With the draft costing c of a target forward and acceptance
# rate a, Leviathan et al.'s Theorem 3.8 gives the expected speedup (1 - a^(K+1)) / ((1 - a)(cK + 1)); for the
# Qwen2.5-Coder 0.5B/1.5B pair on CPU (c ~ 0.45, a ~ 0.7-0.9) it peaks at K = 2..4.
DEFAULT_NUM_LOOKAHEAD = 3


@dataclass(frozen=True)
class SpeculativeConfig:
    """Options of speculative sampling; every field has a default, so `SpeculativeConfig()` is a good start.

    Attributes:
        num_lookahead: draft tokens proposed per round (K). None picks the library default.
    """

    num_lookahead: int | None = None

    def __post_init__(self) -> None:
        if self.num_lookahead is not None:
            if isinstance(self.num_lookahead, bool) or not isinstance(self.num_lookahead, int):
                raise TypeError(f"num_lookahead must be an int (draft tokens per round), got {self.num_lookahead!r}.")
            if self.num_lookahead < 1:
                raise ValueError(
                    f"num_lookahead must be >= 1 (draft tokens proposed per round), got {self.num_lookahead}. "
                    "To generate without drafting, call generate() without `draft_model=`."
                )

    @property
    def lookahead(self) -> int:
        """The number of draft tokens per round actually used."""
        return self.num_lookahead if self.num_lookahead is not None else DEFAULT_NUM_LOOKAHEAD

    @classmethod
    def resolve(cls, config: "SpeculativeConfig | None", num_lookahead: int | None) -> "SpeculativeConfig":
        """Merge the `speculative_config=` object with the `num_lookahead=` shortcut (the shortcut wins)."""
        if config is not None and not isinstance(config, SpeculativeConfig):
            raise TypeError(f"speculative_config must be a SpeculativeConfig, got {type(config).__name__}.")
        config = config if config is not None else cls()
        return replace(config, num_lookahead=num_lookahead) if num_lookahead is not None else config
