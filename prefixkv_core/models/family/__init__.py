"""The families the engine runs, one module each: what a family declares (`base.Family`, the hooks of
`base.FamilyModule`) and the modules that declare them (`llava`, `qwen_vl`). `models.families` gathers them into
the registry the rest of the package reads."""
