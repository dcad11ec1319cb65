"""Tests of zeroshard/comm/."""
