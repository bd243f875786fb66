"""What every spec section shares: strict fields and errors located at a field's path."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

Layout = Literal["zigzag", "striped", "contiguous"]

MAX_SEQ_LEN = 1 << 24  # 16M tokens: far beyond any ring we can place, still a sane upper bound
MAX_WORLD = 4096
MAX_MLP_TILES = 4096  # train.tiled_mlp: a tile count beyond this is a typo


class StrictModel(BaseModel):
    """Unknown fields are errors; floats must be finite; counts must be real integers.

    pydantic's lax mode would read `steps: true` as 1 and `steps: "10"` as 10; for sizes and counts
    that is a typo to report, not to guess. (Floats stay lax: PyYAML reads `3e-4` as text, and that
    should still work.)
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)
    auto_fields: ClassVar[frozenset[str]] = frozenset()  # integer fields that also accept "auto"

    @model_validator(mode="before")
    @classmethod
    def _integers_are_integers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                if name in cls.auto_fields and value == "auto":
                    continue
                if field.annotation in (int, int | None) and isinstance(value, bool | str):
                    fail(
                        name,
                        value,
                        f"{name} must be an integer, got {type(value).__name__} {value!r}",
                    )
        return data


def fail(path: str, value: Any, message: str) -> None:
    """Raise a ValidationError located at `path` (dotted, e.g. ``data.seq_len``): the API's 422."""
    loc = tuple(int(p) if p.isdigit() else p for p in path.split("."))
    err = PydanticCustomError("spec_rule", message)
    raise ValidationError.from_exception_data(
        "JobSpec", [InitErrorDetails(type=err, loc=loc, input=value)]
    )
