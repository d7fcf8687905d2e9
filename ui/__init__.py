"""The Gradio front end. Imports prefixkv_core, never transformers."""
