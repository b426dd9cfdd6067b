"""Paths into the param pytree (nested dicts and lists of arrays, models/layout.py): the helpers the loaders,
the weight packing and the LoRA pool share. Imports nothing of atlas_jax."""


def set_path(tree: dict, path: tuple, value) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def get_path(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def path_of(keys) -> tuple:
    """A jax key path (tree_flatten_with_path) as a param path: ('layers', 3, 'attn', 'q')."""
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in keys)


def replace_at(tree, paths, fn):
    """tree with the node at each path (a leaf or a subtree) replaced by fn(node); the dicts and lists on the
    way down are copied, every other node is the same object."""
    def replace(node, path):
        if not path:
            return fn(node)
        copy = dict(node) if isinstance(node, dict) else list(node)
        copy[path[0]] = replace(node[path[0]], path[1:])
        return copy
    for path in paths:
        tree = replace(tree, tuple(path))
    return tree


def as_lists(tree):
    """{'layers': {0: .., 1: ..}} -> {'layers': [.., ..]} (integer-keyed dicts become lists)."""
    if isinstance(tree, dict):
        if tree and all(isinstance(k, int) for k in tree):
            return [as_lists(tree[k]) for k in sorted(tree)]
        return {k: as_lists(v) for k, v in tree.items()}
    return tree
