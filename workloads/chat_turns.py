"""``python -m workloads.chat_turns``: multi-turn chat, Flying's defaults vs groups off
(``workloads.comparisons.chat_turns``)."""

from workloads.comparisons.chat_turns import main

if __name__ == "__main__":
    main()
