"""The one place of the default model's name (imports nothing: the CLI reads it before torch is loaded)."""

#: the zoo model every door uses when none is named (the README's report, ``load_model()``, ``posgen-tl``)
DEFAULT_MODEL = "smollm2-135m"
