"""The session and its turn: the engine that holds a model, one conversation's turn loop, how its rows are
scheduled, the prefill that starts every method, and what one method carries through the turns."""
