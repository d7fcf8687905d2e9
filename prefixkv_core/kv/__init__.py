"""What the policies act on: the tracked cache (entries with their true positions, image flags and scores),
its packed low-bit form, and the attention function that reads it and measures importance."""
