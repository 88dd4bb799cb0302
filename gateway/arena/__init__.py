"""The private arena: blind battles between two served models, votes, and the leaderboard page."""
