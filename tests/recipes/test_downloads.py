"""Corpus downloads (recipes/data/download.py): through pooch into the project's cache, retried,
checked against the pinned sha256, and one line naming the URL and --raw-dir without network.
No test reaches the internet: a local HTTP server on 127.0.0.1, a closed port, or a proxy
that refuses (what a machine without network sees)."""

import hashlib
import http.server
import os
import socket
import subprocess
import sys
import tarfile
import threading

import pytest

from fairseq_plugins.recipes.data import download, iwslt, language_modeling, multi30k, wmt
from fairseq_plugins.recipes.data.download import Archive, DownloadFailed, locate
from tests.cli import REPO


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


@pytest.fixture
def server(tmp_path):
    """A local HTTP server of ``tmp_path/www`` that answers 500 to the first ``fail_first``
    requests of a path (a dropped download); ``requests`` counts the requests per path."""
    www = tmp_path / "www"
    www.mkdir()
    state = {"fail_first": 0, "requests": {}}

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(www), **kwargs)

        def do_GET(self):
            seen = state["requests"][self.path] = state["requests"].get(self.path, 0) + 1
            if seen <= state["fail_first"]:
                self.send_error(500)
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield www, f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()
    httpd.server_close()


def _corpus_archive(www):
    (www / "corpus.en").write_text("a sentence\n")
    with tarfile.open(www / "c.tgz", "w:gz") as tar:
        tar.add(www / "corpus.en", arcname="c/corpus.en")
    (www / "corpus.en").unlink()
    return hashlib.sha256((www / "c.tgz").read_bytes()).hexdigest()


def test_a_dropped_download_is_retried_checked_and_unpacked(server, tmp_path):
    www, url, state = server
    digest = _corpus_archive(www)
    state["fail_first"] = 1
    found = locate([Archive(f"{url}/c.tgz", ["corpus.en"], digest)], None, tmp_path / "cache")
    assert found["corpus.en"].read_text() == "a sentence\n"
    assert state["requests"]["/c.tgz"] == 2
    assert found["corpus.en"].is_relative_to(tmp_path / "cache")


def test_a_download_with_another_sha256_is_not_kept(server, tmp_path):
    www, url, state = server
    _corpus_archive(www)
    with pytest.raises(ValueError, match="does not match the known hash"):
        locate([Archive(f"{url}/c.tgz", ["corpus.en"], "0" * 64)], None, tmp_path / "cache")
    assert state["requests"]["/c.tgz"] == 1 + download.RETRIES
    assert not list((tmp_path / "cache").iterdir())  # nothing kept, nothing unpacked


def test_without_network_one_line_names_the_url_and_raw_dir(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}/corpus.tgz"
    with pytest.raises(DownloadFailed) as err:
        locate([Archive(url, ["corpus.en"])], None, tmp_path / "cache")
    message = str(err.value)
    assert "\n" not in message
    assert message == (f"could not download {url} (no connection, {1 + download.RETRIES} tries): download "
                       "corpus.tgz on a machine with network and pass the folder that holds it (packed or "
                       "unpacked) with --raw-dir")


def test_prepare_data_without_network_exits_with_one_error_line(tmp_path):
    """The documented check: ``fairseq-plugins-prepare-data multi30k-en-de`` behind a proxy that
    refuses every connection, with the cache in ``$FAIRSEQ_PLUGINS_CACHE``."""
    proxy = f"http://127.0.0.1:{_closed_port()}"
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "http_proxy", "https_proxy",
                                                                     "all_proxy")}
    env.update(PYTHONPATH=str(REPO), HTTPS_PROXY=proxy, HTTP_PROXY=proxy, FAIRSEQ_PLUGINS_CACHE=str(tmp_path / "c"))
    code = ("import sys; sys.argv = ['fairseq-plugins-prepare-data', 'multi30k-en-de', '--out', sys.argv[1]]; "
            "from fairseq_plugins.recipes.console import prepare_data; sys.exit(prepare_data())")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("[prepare] ")]
    assert errors == [f"fairseq-plugins-prepare-data: error: could not download {multi30k.RAW_URL}/train.en.gz "
                      f"(no connection, {1 + download.RETRIES} tries): download train.en.gz on a machine with "
                      "network and pass the folder that holds it (packed or unpacked) with --raw-dir"], proc.stderr
    assert (tmp_path / "c" / "raw").is_dir()  # the project's cache folder, not ~/.cache


def test_moving_branches_are_not_downloaded():
    """GitHub files come from a commit, whose hash fixes their content."""
    for archive in [*multi30k.FILES, *language_modeling.PTB]:
        assert "/master/" not in archive.url and "/main/" not in archive.url
        assert len(archive.sha256) == 64


def test_archives_with_a_published_sha256_pin_it():
    pinned = [wmt.EUROPARL_V7, wmt.COMMONCRAWL, wmt.NEWS_COMMENTARY_V9, wmt.NEWS_COMMENTARY_V12_DE_EN,
              wmt.NEWS_COMMENTARY_V12_ZH_EN, wmt.EUROPARL_V8, language_modeling.ENWIK8, language_modeling.WIKITEXT2,
              *language_modeling.PTB, *multi30k.FILES]
    assert all(len(a.sha256) == 64 and int(a.sha256, 16) >= 0 for a in pinned)
    # none published for these: fairseq's IWSLT14 mirror, WIT3's IWSLT15, OPUS's Moses zip, text8
    assert [a.sha256 for a in (iwslt.IWSLT14_DE_EN, iwslt.IWSLT15_ZH_EN, wmt.SETIMES2, language_modeling.TEXT8)] \
        == [None] * 4


def test_a_sacrebleu_test_set_without_network_is_a_one_line_error(monkeypatch):
    """sacrebleu's own download fails (an OSError, as urllib's URLError is): the same one-line
    CommandError as the archives, naming the sacrebleu command that fills its cache."""
    from sacrebleu.dataset import DATASETS

    from fairseq_plugins.recipes.data.sacrebleu_sets import sacrebleu_split

    def offline(langpair):
        raise OSError("<urlopen error [Errno 101] Network is unreachable>")

    monkeypatch.setattr(DATASETS["wmt14"], "get_files", offline)
    with pytest.raises(DownloadFailed, match=r"sacrebleu -t wmt14 -l en-de --echo src") as err:
        sacrebleu_split("wmt14", "en-de")
    assert "\n" not in str(err.value)
