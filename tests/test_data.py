from infopt_lab import data


def test_split_is_deterministic_disjoint_and_by_file():
    train, val = data.corpus_files("train"), data.corpus_files("val")
    assert train and val
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(data.corpus_files("all"))
    assert list(train) == sorted(train)
    root = data.stdlib_dir()
    for path in val:
        assert data.split_of(path.relative_to(root).as_posix()) == "val"


def test_test_suites_are_left_out():
    root = data.stdlib_dir()
    for path in data.corpus_files("all"):
        rel = path.relative_to(root)
        assert "test" not in rel.parts[:-1] and not rel.name.startswith("test_")


def test_bad_split_name():
    import pytest
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'val', 'all'\), got 'dev'"):
        data.corpus_files("dev")


def test_tokenizer_round_trips_and_counts_bytes():
    from infopt_lab.loading import bundled_model_dir
    tok = data.load_tokenizer(bundled_model_dir("target"))
    text = "def f(x):\n    return {'é': x ** 2}  # ünïcode\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id                       # prompts start like a file does
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert int(data.token_byte_lengths(tok)[ids].sum()) == len(text.encode("utf-8"))


def test_autotokenizer_opens_a_bundled_directory():
    from transformers import AutoTokenizer
    from infopt_lab.loading import bundled_model_dir
    path = bundled_model_dir("target")
    assert AutoTokenizer.from_pretrained(path).encode("import os") == \
        data.load_tokenizer(path).encode("import os")


def test_val_stream_encodes_every_byte():
    from infopt_lab.loading import bundled_model_dir
    tok = data.load_tokenizer(bundled_model_dir("target"))
    tokens, n_bytes = data.encode_split(tok, "val")
    assert int(data.token_byte_lengths(tok)[tokens.astype("int64")].sum()) == n_bytes
