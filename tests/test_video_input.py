"""Video input: uniform frame sampling from files and frame lists, and the refusals of bad input."""
from __future__ import annotations

import os
from fractions import Fraction

import av
import numpy as np
import pytest
from PIL import Image

from prefixkv_core.errors import EngineError
from prefixkv_core.session import video_input
from prefixkv_core.session.video_input import (
    MAX_FRAMES, VIDEO_REFUSED, VideoClip, check_frames, load_video, sample_indices, write_video)

STEP = 6  # frame i is solid grey 6*i, so a sampled frame's mean tells which frame it was


def grey_frames(n, size=(64, 48)):
    return [Image.new("RGB", size, (STEP * i,) * 3) for i in range(n)]


def clip_file(tmp_path, n=20, name="clip.mp4", fps=8):
    return write_video(grey_frames(n), tmp_path / name, fps=fps)


def frame_numbers(clip):
    return [round(float(np.asarray(f.convert("L")).mean()) / STEP) for f in clip.frames]


def test_samples_uniformly_over_the_stream(tmp_path):
    clip = load_video(clip_file(tmp_path, 20), frames=8)
    expected = np.linspace(0, 19, 8, dtype=int).tolist()
    assert frame_numbers(clip) == expected == sample_indices(20, 8)
    assert clip.total_frames == 20 and clip.fps == pytest.approx(8)
    assert clip.duration_s == pytest.approx(2.5)
    assert clip.timestamps == pytest.approx([i / 8 for i in expected])
    assert clip.size == (64, 48) and clip.source == "clip.mp4"
    assert all(f.mode == "RGB" and f.size == (64, 48) for f in clip.frames)
    record = clip.describe()
    assert record["frames"] == 8 and record["total_frames"] == 20 and record["size"] == [64, 48]


def test_container_without_a_frame_count(tmp_path):
    path = clip_file(tmp_path, 17, name="clip.mkv")
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0  # Matroska does not say: the engine counts
    clip = load_video(path, frames=5)
    assert clip.total_frames == 17
    assert frame_numbers(clip) == np.linspace(0, 16, 5, dtype=int).tolist()


def test_the_count_comes_from_the_packets_not_the_header(tmp_path):
    """A stream cut short (a damaged upload) holds fewer frames than written: they are counted from the packets that
    are there, and the sample spreads over those."""
    path = clip_file(tmp_path, 40, name="clip.mkv")
    data = path.read_bytes()
    cut = tmp_path / "cut.mkv"
    cut.write_bytes(data[: len(data) * 2 // 3])
    clip = load_video(cut, frames=4)
    assert 4 < clip.total_frames < 40
    got = frame_numbers(clip)  # in presentation order, from the part that is there (B-frames: not quite a prefix)
    assert len(got) == 4 and got[0] == 0 and got == sorted(set(got)) and got[-1] < 40
    assert clip.decoded_frames <= clip.total_frames


def numbered_frames(n, size=(64, 48)):
    """Frame i carries i in base 16, a digit a channel in steps of 16, so up to 4096 frames survive lossy coding."""
    return [Image.new("RGB", size, (16 * (i // 256), 16 * (i // 16 % 16), 16 * (i % 16))) for i in range(n)]


def numbers_of(clip):
    out = []
    for f in clip.frames:
        r, g, b = np.asarray(f).reshape(-1, 3).mean(axis=0)
        out.append(256 * round(r / 16) + 16 * round(g / 16) + round(b / 16))
    return out


def write_gop_clip(path, n, keyint, fps=30):
    """H.264 with a keyframe every `keyint` frames (and B-frames, x264's default)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps, options={"g": str(keyint), "keyint_min": str(keyint),
                                                                    "sc_threshold": "0", "crf": "10"})
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for image in numbered_frames(n):
            container.mux(stream.encode(av.VideoFrame.from_image(image)))
        container.mux(stream.encode())
    return path


@pytest.mark.skipif("libx264" not in av.codecs_available, reason="needs the bundled libx264")
def test_sampled_frames_are_reached_by_seeking(tmp_path):
    """The decoder goes through the group of pictures before each sampled frame, not the whole stream."""
    path = write_gop_clip(tmp_path / "long.mp4", 1200, keyint=30)
    clip = load_video(path, frames=4)
    assert numbers_of(clip) == np.linspace(0, 1199, 4, dtype=int).tolist() and clip.total_frames == 1200
    assert clip.decoded_frames <= 4 * 30 + 8
    one = load_video(path, frames=1)
    assert numbers_of(one) == [0] and one.decoded_frames <= 4
    many = load_video(path, frames=64)  # neighbouring samples in one group: decoded once, never past the last one
    assert numbers_of(many) == np.linspace(0, 1199, 64, dtype=int).tolist()
    assert many.decoded_frames <= 64 * 30 and many.describe()["decoded_frames"] == many.decoded_frames


@pytest.mark.skipif("libx264" not in av.codecs_available, reason="needs the bundled libx264")
def test_a_stream_with_few_keyframes_is_refused_before_decoding(tmp_path, monkeypatch):
    path = write_gop_clip(tmp_path / "one-key.mp4", 600, keyint=1000)
    bounds = video_input.DecodeBounds(decode_pixels=100 * 64 * 48)
    decoded = []
    monkeypatch.setattr(video_input, "_decode", lambda *a: decoded.append(a))
    with pytest.raises(EngineError, match=r"reaching 4 sampled frames means decoding 59\d frames of this video "
                                          r"\(0\.0 gigapixels; its keyframes are far apart\); the limit is"):
        load_video(path, frames=4, bounds=bounds)
    assert decoded == []
    monkeypatch.undo()
    assert numbers_of(load_video(path, frames=1, bounds=bounds)) == [0]  # its first frame costs one decode
    with pytest.raises(EngineError, match=r"decoding the video took more than 1e-09 s and was stopped"):
        load_video(path, frames=4, bounds=video_input.DecodeBounds(decode_s=1e-9))


def write_jpeg_avi(path, sizes, fps=8):
    """An MJPEG AVI whose header states the first frame's size; each later frame is a JPEG of its own size, muxed
    as it is (a decoder takes each frame's size from the frame)."""
    import io

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mjpeg", rate=fps)
        stream.width, stream.height, stream.pix_fmt = sizes[0][0], sizes[0][1], "yuvj420p"
        for k, size in enumerate(sizes):
            buf = io.BytesIO()
            Image.new("RGB", size, (STEP * k,) * 3).save(buf, "JPEG", quality=50)
            packet = av.Packet(buf.getvalue())
            packet.stream, packet.pts, packet.dts = stream, k, k
            packet.time_base = Fraction(1, fps)
            container.mux(packet)
    return path


def test_every_decoded_frame_is_held_to_the_limits(tmp_path):
    """A header that states small frames does not let larger ones through: each frame is measured as it decodes,
    the sampled ones together too; frames within the limits are brought to one size."""
    path = write_jpeg_avi(tmp_path / "grows.avi", [(64, 48)] + [(640, 480)] * 7)
    with pytest.raises(EngineError, match=r"a frame of the video is 640×480 pixels \(its header says 64×48\); "
                                          r"the limit is 0\.1 megapixels a frame"):
        load_video(path, frames=4, bounds=video_input.DecodeBounds(frame_pixels=100_000))
    with pytest.raises(EngineError, match=r"the 4 sampled frames hold more than 0\.5 megapixels \(frames of "
                                          r"640×480 pixels, larger than the video's header says\)"):
        load_video(path, frames=4, bounds=video_input.DecodeBounds(clip_pixels=500_000))
    clip = load_video(path, frames=4)
    assert clip.size == (64, 48) and all(f.size == (64, 48) for f in clip.frames)
    assert frame_numbers(clip) == [0, 2, 4, 7]


def test_streams_longer_than_the_limit_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(video_input, "MAX_STREAM_FRAMES", 10)
    with pytest.raises(EngineError, match="the video has 20 frames; the limit is 10: send a shorter clip"):
        load_video(clip_file(tmp_path, 20), frames=2)  # from the header
    with pytest.raises(EngineError, match="the video has more than 10 frames; the limit is 10"):
        load_video(clip_file(tmp_path, 20, name="clip.mkv"), frames=2)  # no count stated: read that far only


def test_avi_frames_are_stamped_by_index(tmp_path):
    clip = load_video(clip_file(tmp_path, 9, name="clip.avi"), frames=5)
    assert frame_numbers(clip) == [0, 2, 4, 6, 8]
    assert clip.timestamps == pytest.approx([0, 0.25, 0.5, 0.75, 1.0]) and clip.duration_s == pytest.approx(9 / 8)


def test_fewer_frames_than_asked_gives_every_frame_once(tmp_path):
    clip = load_video(clip_file(tmp_path, 10), frames=16)
    assert frame_numbers(clip) == list(range(10))
    assert clip.describe()["frames"] == clip.describe()["total_frames"] == 10


def test_one_frame_and_increasing_timestamps(tmp_path):
    path = clip_file(tmp_path, 40)
    one = load_video(path, frames=1)
    assert frame_numbers(one) == [0] and one.timestamps == (0.0,)
    many = load_video(path, frames=MAX_FRAMES)
    assert len(many.frames) == 40
    assert all(b > a for a, b in zip(many.timestamps, many.timestamps[1:]))


@pytest.mark.parametrize("frames", [0, 65, -1, 2.5, True, "8"])
def test_frames_out_of_range(tmp_path, frames):
    with pytest.raises(EngineError, match=f"1 to {MAX_FRAMES}"):
        load_video(grey_frames(3), frames=frames)
    with pytest.raises(EngineError, match=f"1 to {MAX_FRAMES}"):
        load_video(None, frames=frames)
    with pytest.raises(EngineError, match=f"1 to {MAX_FRAMES}"):
        check_frames(frames)
    assert check_frames(np.int64(8)) == 8


def test_list_of_frames_and_clips(tmp_path):
    clip = load_video(grey_frames(12), frames=4)
    assert frame_numbers(clip) == [0, 3, 7, 11]
    assert clip.timestamps == (0.0, 3.0, 7.0, 11.0) and clip.fps == 1.0 and clip.total_frames == 12
    assert load_video(clip, frames=4) == clip
    assert frame_numbers(load_video(clip, frames=2)) == [0, 11]
    assert load_video(None) is None
    with pytest.raises(EngineError, match="PIL images"):
        load_video([])
    with pytest.raises(EngineError, match="file path"):
        load_video(b"bytes")


def test_large_frames_are_downscaled_and_huge_streams_refused(tmp_path, monkeypatch):
    path = clip_file(tmp_path, 4)
    monkeypatch.setattr(video_input, "MAX_FRAME_SIDE", 32)
    assert load_video(path, frames=2).size == (32, 24)
    monkeypatch.setattr(video_input, "MAX_VIDEO_PIXELS", 64 * 47)
    with pytest.raises(EngineError, match="64×48 pixels"):
        load_video(path)


def write_audio_only(path):
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=16000)
        samples = np.zeros((1, 1024), dtype=np.float32)
        for _ in range(4):
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            frame.sample_rate = 16000
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def test_files_that_are_not_videos(tmp_path):
    (tmp_path / "noise.mp4").write_bytes(np.random.default_rng(0).bytes(4000))
    real = clip_file(tmp_path, 20).read_bytes()
    (tmp_path / "half.mp4").write_bytes(real[: len(real) // 2])
    (tmp_path / "notes.txt").write_text("not a video\n" * 20)
    Image.new("RGB", (16, 16)).save(tmp_path / "picture.png")
    os.rename(tmp_path / "picture.png", tmp_path / "picture.mp4")
    for name in ("noise.mp4", "half.mp4", "notes.txt", "picture.mp4"):
        with pytest.raises(EngineError, match=f"{name} is not a readable video"):
            load_video(tmp_path / name)
    write_audio_only(tmp_path / "sound.mp4")
    with pytest.raises(EngineError, match="sound.mp4 has no video stream"):
        load_video(tmp_path / "sound.mp4")


def test_missing_folder_and_too_big(tmp_path):
    with pytest.raises(EngineError, match="cannot open gone.mp4: No such file"):
        load_video(tmp_path / "gone.mp4")
    with pytest.raises(EngineError, match="is a folder"):
        load_video(tmp_path)
    path = clip_file(tmp_path, 10)
    with pytest.raises(EngineError, match="the limit is"):
        load_video(path, max_bytes=path.stat().st_size - 1)
    assert load_video(path, max_bytes=path.stat().st_size).total_frames == 10


def test_server_refusals_say_nothing_about_the_disk(tmp_path):
    inside, outside = tmp_path / "uploads", tmp_path / "private"
    inside.mkdir()
    outside.mkdir()
    secret = clip_file(outside, 10, name="secret.mp4")
    (inside / "link.mp4").symlink_to(secret)
    (inside / "noise.mp4").write_bytes(b"\x00" * 500)
    write_audio_only(inside / "sound.mp4")
    for path in (secret, inside / "link.mp4", inside / "gone.mp4", inside, inside / "noise.mp4",
                 inside / "sound.mp4"):
        with pytest.raises(EngineError) as info:
            load_video(path, allowed_roots=inside)
        assert str(info.value) == VIDEO_REFUSED
        assert str(tmp_path) not in str(info.value) and path.name not in str(info.value)
    ok = clip_file(inside, 10, name="ok.mp4")
    assert load_video(str(ok), frames=3, allowed_roots=[str(inside)]).total_frames == 10


def test_clip_is_frozen(tmp_path):
    clip = load_video(grey_frames(2))
    assert isinstance(clip, VideoClip)
    with pytest.raises(AttributeError):
        clip.fps = 2.0
