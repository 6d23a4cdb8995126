"""ENGINE_CORE_DEAD names the engine (second frame); the one-frame form still means death."""

from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import ENGINE_CORE_DEAD, EngineDead


def test_dead_frames_name_the_engine() -> None:
    frames = zmq_channel.engine_dead_frames(3, "EngineCore_DP3-x")
    assert frames[0] == ENGINE_CORE_DEAD
    assert zmq_channel.parse_output_frames(frames) == (None, [])
    assert zmq_channel.parse_engine_dead(frames) == EngineDead(3, "EngineCore_DP3-x")


def test_one_frame_dead_names_no_engine() -> None:
    assert zmq_channel.parse_output_frames([ENGINE_CORE_DEAD]) == (None, [])
    assert zmq_channel.parse_engine_dead([ENGINE_CORE_DEAD]) is None


def test_undecodable_second_frame_is_still_a_death() -> None:
    frames = [ENGINE_CORE_DEAD, b"\xc1"]
    assert zmq_channel.parse_output_frames(frames) == (None, [])
    assert zmq_channel.parse_engine_dead(frames) is None
