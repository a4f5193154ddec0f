"""Models whose weights lie in external data files: read where they lie, never held whole."""

from __future__ import annotations

import copy
import os

import numpy as np
import onnx
import pytest

import sparse_attention_op as sao
from sparse_attention_op.cli import main
from sparse_attention_op.ort.model import load_for_session
from sparse_attention_op.ort.session import _EXTERNAL_FOLDER
from sparse_attention_op.testing.decoder_models import BUNDLED_MODELS, build_decoder

LAYOUTS = ("block_row_indices", "block_col_indices")


def save_external(model: onnx.ModelProto, path) -> None:
    model = copy.deepcopy(model)  # onnx.save moves the tensors it writes out of the proto it is given
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=f"{path.name}.data", size_threshold=512)


@pytest.fixture(scope="module")
def decoder():
    return build_decoder(BUNDLED_MODELS["phi3-small-tiny"])


def test_a_layout_is_read_through_a_linked_data_file(decoder, tmp_path):
    # A model hub's snapshot folder: the model and its data are links into a folder of blobs.
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snapshot").mkdir()
    save_external(decoder, tmp_path / "blobs" / "model.onnx")
    for name in ("model.onnx", "model.onnx.data"):
        os.symlink(tmp_path / "blobs" / name, tmp_path / "snapshot" / name)
    proto, folder = load_for_session(tmp_path / "snapshot" / "model.onnx")
    expected = {t.name: onnx.numpy_helper.to_array(t) for t in decoder.graph.initializer if t.name in LAYOUTS}
    read = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer if t.name in LAYOUTS}
    assert read.keys() == expected.keys() and all(np.array_equal(read[k], expected[k]) for k in expected)
    assert folder == (tmp_path / "snapshot").resolve()
    sao.prepare_model(proto)  # the layouts' rules run on the values read


def test_a_missing_data_file_names_the_tensor(decoder, tmp_path):
    save_external(decoder, tmp_path / "model.onnx")
    os.remove(tmp_path / "model.onnx.data")
    with pytest.raises(sao.SparseAttentionError, match="tensor 'block_row_indices': cannot read its external data"):
        load_for_session(tmp_path / "model.onnx")


def test_reused_options_do_not_carry_one_models_weights_folder_to_the_next(decoder, tmp_path):
    import onnxruntime as ort

    save_external(decoder, tmp_path / "model.onnx")
    options = ort.SessionOptions()
    prompts = [[5, 17, 33]]
    first = sao.generate(sao.create_session(tmp_path / "model.onnx", options), prompts, 4)
    assert options.get_session_config_entry(_EXTERNAL_FOLDER) == str(tmp_path.resolve())
    second = sao.generate(sao.create_session(decoder, options), prompts, 4)  # a ModelProto: its weights inline
    assert options.get_session_config_entry(_EXTERNAL_FOLDER) == os.getcwd()
    assert first.tokens == second.tokens == sao.generate(decoder, prompts, 4).tokens


def test_the_cli_runs_a_model_with_external_weights_from_its_path(decoder, tmp_path, capsys):
    save_external(decoder, tmp_path / "model.onnx")
    assert main(["run", str(tmp_path / "model.onnx"), "--seq", "6", "--compare-ort"]) == 0, capsys.readouterr().err
    assert "NO" not in capsys.readouterr().out
