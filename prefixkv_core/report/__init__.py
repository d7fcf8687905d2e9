"""What a comparison reports, in plain Python and numpy: the events, the result record, Lorenz curves and
Gini, the quality metrics and the leaderboard layout."""
