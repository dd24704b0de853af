"""``python -m flying.launch``: the node's command (``flying.node.launch``)."""

from flying.node.launch import main

if __name__ == "__main__":
    main()
