"""The decode path above the policies: one forward over many rows (each a method with its own cache), the
stores those rows share between steps, the vision tower's pass the prefills of a comparison share, the
vision-side token reduction a prefill may run, and the tokens a prefill leaves behind after a layer."""
