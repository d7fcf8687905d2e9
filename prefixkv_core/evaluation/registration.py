"""The entry point lmms-eval reads (group `lmms_eval.models`, declared in pyproject.toml): the manifest that
names our model class, so `--model prefixkv` finds it. Called by lmms-eval only, so importing it is safe."""


def manifest():
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id="prefixkv", simple_class_path="prefixkv_core.evaluation.lmms_model.PrefixKV")
