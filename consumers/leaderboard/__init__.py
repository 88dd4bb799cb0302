"""Arena leaderboard statistics: pure functions of the vote stream, no broker in them.

`votes` turns vote records into a count table, `bradley_terry` fits the model and its
intervals, `ratings` assembles the `Leaderboard` (with the online Elo trend) and keeps
`LeaderboardState` for live updates, `fastchat_format` reads and writes FastChat's
clean-battle JSON. Import from `consumers.leaderboard.ratings`; see docs/arena-statistics.md.
"""
