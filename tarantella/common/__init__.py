"""What the `tarantella` command and the ranks share, on the standard library alone: the settings
(`tarantella.config`), this node's hardware, and the protocol by which a rank reports to the
command (`rank_entry`)."""
