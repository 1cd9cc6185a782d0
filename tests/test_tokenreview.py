"""The shared bearer-token parts (driver/bearer.py, driver/tokenreview.py): the real
kubernetes.aio client reviews tokens against the fake API server over HTTP."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
from timeslice.driver.bearer import TokenFile, bearer
from timeslice.driver.errors import KubernetesApiError, KubernetesApiRejected, Unauthenticated
from timeslice.driver.tokenreview import TokenReviewer

AUD = "timeslice.dev/test"


def test_bearer_takes_the_token_out_of_the_metadata() -> None:
    assert bearer((("x", "y"), ("authorization", "Bearer  abc \n"))) == "abc"
    for md in (None, (), (("authorization", "Basic abc"),), (("authorization", "Bearer  "),)):
        with pytest.raises(Unauthenticated, match=r"^no bearer token$"):
            bearer(md)
    with pytest.raises(Unauthenticated, match="no bearer token: mount one"):
        bearer((), hint="mount one")


async def test_positive_reviews_are_cached_until_they_expire(token_api) -> None:
    server, api = token_api
    server.add_token("t1", "system:serviceaccount:ns:sa", [AUD], extra={"k": ["v1", "v2"]})
    now = [100.0]
    reviewer = TokenReviewer(api, AUD, cache_seconds=60, clock=lambda: now[0])
    user = await reviewer.review("t1")
    assert (user.username, user.uid, user.groups, user.first("k"), user.first("none")) == \
        ("system:serviceaccount:ns:sa", "uid-system:serviceaccount:ns:sa", ("system:serviceaccounts",), "v1", "")
    assert server.reviews == [{"token": "t1", "audiences": [AUD]}]
    now[0] += 59.9
    assert await reviewer.review("t1") == user
    assert len(server.reviews) == 1  # from the cache
    now[0] += 0.2
    await reviewer.review("t1")
    assert len(server.reviews) == 2  # expired: reviewed again


async def test_rejections_are_not_cached(token_api) -> None:
    server, api = token_api
    server.add_token("other-audience", "system:serviceaccount:ns:sa", ["timeslice.dev"])
    reviewer = TokenReviewer(api, AUD)
    for _ in range(2):
        with pytest.raises(Unauthenticated, match=r"token rejected: invalid bearer token$"):
            await reviewer.review("forged")
        with pytest.raises(Unauthenticated, match=r"token rejected: .*invalid for the target audiences"):
            await reviewer.review("other-audience")
    assert len(server.reviews) == 4
    server.add_token("forged", "u", [AUD])  # now valid: a rejection did not stick
    assert (await reviewer.review("forged")).username == "u"


async def test_an_authenticator_that_ignores_the_audience_is_not_trusted() -> None:
    """An authenticated review with empty status.audiences means the token is valid for the
    API server's audience (TokenReviewStatus, authentication.k8s.io/v1), not ours."""

    class AudienceUnaware:
        async def create_token_review(self, body: dict) -> SimpleNamespace:
            return SimpleNamespace(status=SimpleNamespace(authenticated=True, audiences=None, error=None,
                                                          user=SimpleNamespace(username="u")))

    with pytest.raises(Unauthenticated, match=r"not valid for audience timeslice\.dev/test .*audiences \[\]"):
        await TokenReviewer(AudienceUnaware(), AUD).review("t")


async def test_failed_reviews_raise_api_errors(token_api) -> None:
    server, api = token_api
    server.add_token("t1", "u", [AUD])
    reviewer = TokenReviewer(api, AUD)
    server.fail("TokenReview", 503)
    with pytest.raises(KubernetesApiError, match=r"TokenReview for audience timeslice\.dev/test: HTTP 503") as err:
        await reviewer.review("t1")
    assert err.value.retryable
    server.fail("TokenReview", 403)
    with pytest.raises(KubernetesApiRejected, match="HTTP 403: injected 403"):
        await reviewer.review("t1")
    assert (await reviewer.review("t1")).username == "u"  # the failures were not cached

    class Hanging:
        async def create_token_review(self, body: dict) -> None:
            await asyncio.sleep(10)

    with pytest.raises(KubernetesApiError, match="TimeoutError"):
        await TokenReviewer(Hanging(), AUD, timeout=0.05).review("t1")


def test_token_file_is_read_again_only_when_it_changed(tmp_path) -> None:
    path = tmp_path / "token"
    tf = TokenFile(path)
    with pytest.raises(Unauthenticated, match="cannot read the token file"):
        tf.token()
    path.write_text("")
    with pytest.raises(Unauthenticated, match="is empty"):
        tf.token()
    path.write_text("token-1\n")
    assert tf.metadata() == (("authorization", "Bearer token-1"),)
    # same size, same inode, mtime put back: not read again
    st = os.stat(path)
    path.write_text("token-2\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert tf.token() == "token-1"
    # the kubelet's atomic swap: a new file (new inode and mtime) behind the path
    new = tmp_path / "token.new"
    new.write_text("token-3\n")
    os.replace(new, path)
    assert tf.token() == "token-3"
    # gone or empty after a good read: the last token is kept
    path.unlink()
    assert tf.token() == "token-3"
    path.write_text("")
    assert tf.token() == "token-3"
    path.write_text("token-4")
    assert tf.token() == "token-4"
